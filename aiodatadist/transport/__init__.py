"""The data planes, which move a transfer's bytes: :mod:`.same_host` (probe and peer memory: mapped segments or
``process_vm_readv/writev``), :mod:`.directory` (published caches, no round trip), :mod:`.device` (CUDA caches and
IPC), :mod:`.tcp` (data connections across hosts) and :mod:`.base` (what the TCP planes share)."""
