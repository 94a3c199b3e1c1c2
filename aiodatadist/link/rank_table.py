"""The arguments of the two-sided ``link``: ``comm_name``, ``cluster_rank_info`` and the HCCL rank table,
checked as LLM-DataDist checks them, and where each member is reached.

On this hardware a rank table's ``device_ip`` is the member's host IP, and its control port is its listen port:
the extra field ``device_port`` of its device entry, or, when that is absent, the same port as this instance's
listen port.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._checks import check_int, check_isinstance, param_invalid, require

__all__ = ["MAX_COMM_NAME", "Member", "check_comm_args", "members_of"]

MAX_COMM_NAME = 128
MIN_MEMBERS, MAX_MEMBERS = 2, 4


@dataclass(frozen=True)
class Member:
    """One member of a communication domain: its cluster id, rank, and where it listens (``port`` None:
    unknown, see the module)."""

    cluster_id: int
    rank: int
    ip: str
    port: int | None


def check_comm_args(comm_name: Any, cluster_rank_info: Any, rank_table: Any, own_cluster_id: int) -> dict[int, int]:
    """Type and value checks of ``link``'s arguments; returns ``cluster_rank_info`` as a plain dict."""
    check_isinstance("comm_name", comm_name, str)
    check_isinstance("cluster_rank_info", cluster_rank_info, dict)
    check_isinstance("rank_table", rank_table, str)
    require(0 < len(comm_name) < MAX_COMM_NAME, f"comm_name must be 1 to {MAX_COMM_NAME - 1} characters.")
    require(MIN_MEMBERS <= len(cluster_rank_info) <= MAX_MEMBERS,
            f"cluster_rank_info must have {MIN_MEMBERS} to {MAX_MEMBERS} entries, got {len(cluster_rank_info)}.")
    ranks: dict[int, int] = {}
    previous = -1
    for cluster, rank in cluster_rank_info.items():
        cluster_id = check_int("cluster_rank_info key", cluster, "uint64")
        rank_id = check_int("cluster_rank_info value", rank, "uint32")
        require(rank_id > previous, "cluster_rank_info values (rank ids) must be in ascending order.")
        previous = rank_id
        ranks[cluster_id] = rank_id
    require(own_cluster_id in ranks, "local cluster id does not exist in cluster2rank.")
    return ranks


def members_of(rank_table: str, ranks: dict[int, int], own_port: int | None) -> list[Member]:
    """The members named by ``ranks`` (cluster id -> rank) with their addresses from ``rank_table`` (JSON)."""
    try:
        table = json.loads(rank_table)
    except ValueError as exc:
        param_invalid(f"rank_table is not valid JSON: {exc}")
    require(isinstance(table, dict), "rank_table must be a JSON object.")
    require(str(table.get("version")) in ("1.0", "1.2"), "rank_table version must be \"1.0\" or \"1.2\".")
    require(table.get("status") == "completed", "rank_table status must be \"completed\".")
    servers = table.get("server_list")
    require(isinstance(servers, list) and len(servers) > 0, "rank_table server_list must be a non-empty list.")
    if "server_count" in table:
        require(str(table["server_count"]) == str(len(servers)), "rank_table server_count does not match "
                                                                 "server_list.")
    addresses: dict[int, tuple[str, int | None]] = {}
    for server in servers:
        require(isinstance(server, dict) and isinstance(server.get("device"), list),
                "every rank_table server_list entry needs a device list.")
        for device in server["device"]:
            require(isinstance(device, dict), "rank_table device entries must be objects.")
            try:
                rank = int(device["rank_id"])
                ip = str(device["device_ip"])
                port = int(device["device_port"]) if "device_port" in device else None
            except (KeyError, TypeError, ValueError):
                param_invalid(f"rank_table device entry {device!r} needs rank_id, device_ip (and an integer "
                              "device_port, if any).")
            require(rank not in addresses, f"rank_table names rank {rank} twice.")
            require(port is None or 0 < port <= 65535, f"rank_table device_port {port} out of range.")
            addresses[rank] = (ip, port)
    members = []
    for cluster_id, rank in ranks.items():
        require(rank in addresses, f"rank {rank} of cluster {cluster_id} is not in rank_table.")
        ip, port = addresses[rank]
        members.append(Member(cluster_id, rank, ip, port if port is not None else own_port))
    return members
