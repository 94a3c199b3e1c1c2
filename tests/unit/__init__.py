"""Fast tests: no peer process, no link, no network socket."""
