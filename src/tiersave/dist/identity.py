"""Where each rank runs: node rank, local rank, hostname, as torchrun reports them or as derived.

Scope: this rank's claim (overrides, else torchrun's ``GROUP_RANK``/``LOCAL_RANK`` and the hostname) and rank
0's derivation of every rank's :class:`NodeIdentity` from the claims, with a duplicate check.

Anti-scope: exchanging the claims (``group.py`` does it once, at construction).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from ..errors import ConfigError
from .wire import Decline, Json, failure_report, rank_list, report_error

__all__ = ["NodeIdentity", "derive_identities", "identity_claim"]


@dataclass(frozen=True)
class NodeIdentity:
    """Where one rank runs.

    Attributes:
        rank: rank in the coordination group.
        world_size: ranks in the group.
        node_rank: the node's index (torchrun's ``GROUP_RANK`` when set, else the order in which hostnames
            first appear by rank).
        local_rank: index on the node (``LOCAL_RANK`` when set, else the order by rank among the node's ranks).
        local_world_size: ranks on this node.
        num_nodes: nodes in the group.
        hostname: the host's name (two simulated nodes on one machine share it; ``node_rank`` tells them apart).
    """

    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    hostname: str


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def identity_claim(node_rank: int | None, local_rank: int | None, hostname: str | None) -> dict[str, Json]:
    """What this rank says about itself: the overrides, else torchrun's variables and the hostname.

    Raises:
        ConfigError: ``GROUP_RANK`` or ``LOCAL_RANK`` is set but not an integer.
    """
    return {
        "hostname": hostname if hostname is not None else socket.gethostname(),
        "node_rank": node_rank if node_rank is not None else _env_int("GROUP_RANK"),
        "local_rank": local_rank if local_rank is not None else _env_int("LOCAL_RANK"),
    }


def derive_identities(docs: list[Json]) -> Json:
    """Rank 0's setup decision: every rank's identity, checked for duplicates, plus the group's nonce."""
    claims = [doc if isinstance(doc, dict) else {} for doc in docs]
    world = len(claims)
    hostnames = [str(c.get("hostname", "")) for c in claims]
    given = [c.get("node_rank") for c in claims]
    if all(isinstance(n, int) for n in given):
        node_ranks = [int(n) for n in given if isinstance(n, int)]
    elif any(n is not None for n in given):
        missing = [r for r, n in enumerate(given) if n is None]
        raise Decline(
            failure_report(
                op="setup",
                phase="decide",
                step=None,
                summary=f"{rank_list(missing)} have no node rank while others do (GROUP_RANK set on some nodes only)",
                failures={r: report_error(ConfigError("no node rank (GROUP_RANK unset)")) for r in missing},
                poison=False,
            )
        )
    else:
        order: dict[str, int] = {}
        node_ranks = [order.setdefault(h, len(order)) for h in hostnames]
    members: dict[int, list[int]] = {}
    for r, n in enumerate(node_ranks):
        members.setdefault(n, []).append(r)
    local_ranks = []
    for r, c in enumerate(claims):
        claimed = c.get("local_rank")
        local_ranks.append(int(claimed) if isinstance(claimed, int) else members[node_ranks[r]].index(r))
    seen: dict[tuple[int, int], int] = {}
    clashes: dict[int, dict[str, Json]] = {}
    for r in range(world):
        key = (node_ranks[r], local_ranks[r])
        if key in seen:
            text = f"rank {r} and rank {seen[key]} both claim node {key[0]}, local rank {key[1]}"
            clashes[r] = report_error(ConfigError(text))
        seen.setdefault(key, r)
    if clashes:
        raise Decline(
            failure_report(
                op="setup",
                phase="decide",
                step=None,
                summary=f"{rank_list(sorted(clashes))} duplicate another rank's node and local rank",
                failures=clashes,
                poison=False,
            )
        )
    rows: list[Json] = [
        {
            "rank": r,
            "world_size": world,
            "node_rank": node_ranks[r],
            "local_rank": local_ranks[r],
            "local_world_size": len(members[node_ranks[r]]),
            "num_nodes": len(members),
            "hostname": hostnames[r],
        }
        for r in range(world)
    ]
    return {"identities": rows, "nonce": secrets.token_hex(8)}
