"""Training settings every member of a cluster must share, and the words that name a disagreement.

A node declares its settings (strategy, period, codecs, model layout, ...) as short name -> value strings
once it attached a model; they travel in every handshake, and two nodes whose settings differ refuse each
other at once with a message naming each differing setting and both values, instead of starting rounds
that can only fail (a different ``period`` gives groups of different sizes) or silently diverge.

A node resuming from a checkpoint disagrees with its own past the same way: a checkpoint records the
settings it was written with, and each node compares them with its config on its own (`resume_changes`).
A setting the saved state is laid out for (`FIXED_ON_RESUME`: the strategy) refuses the resume
(`resume_refusal`); any other is adopted from the config. Every node holds the same config (the handshake
checks it) and checkpoints of the same run, so every node reaches the same answer without asking the others.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# A message lists at most this many differing settings (the rest are counted).
MAX_NAMED = 6


def settings_mismatch(
    mine: Mapping[str, str], theirs: Mapping[str, str], me: str = "this node", them: str = "the peer"
) -> str | None:
    """None when the settings agree (or either side has declared none yet), else what differs, by name.

    A setting only one side declares counts as differing (the other side shows it as "unset"), so a
    node of another version cannot pass silently.
    """
    if not mine or not theirs:
        return None
    names = sorted(set(mine) | set(theirs))
    diffs = [
        f"{name}: {mine.get(name, 'unset')} on {me}, {theirs.get(name, 'unset')} on {them}"
        for name in names
        if mine.get(name) != theirs.get(name)
    ]
    if not diffs:
        return None
    more = f"; and {len(diffs) - MAX_NAMED} more" if len(diffs) > MAX_NAMED else ""
    return "training settings differ (every member must use the same): " + "; ".join(diffs[:MAX_NAMED]) + more


# Settings a checkpoint resumes only under: its saved state is laid out for them (another strategy keeps
# other state; see `resume_refusal`). Every other setting changed since the checkpoint is adopted.
FIXED_ON_RESUME: tuple[str, ...] = ("sync.strategy",)


def resume_changes(saved: Mapping[str, str], current: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(name, saved value, configured value) of each setting that changed since a checkpoint, by name.

    Only settings both sides name count: a checkpoint of an older version records fewer, and what it did
    not record cannot be compared.
    """
    return [
        (name, saved[name], current[name]) for name in sorted(set(saved) & set(current)) if saved[name] != current[name]
    ]


def resume_refusal(
    changes: list[tuple[str, str, str]], fixed: Collection[str] = FIXED_ON_RESUME, where: str = "the checkpoint"
) -> str | None:
    """Why a resume with ``changes`` (see :func:`resume_changes`) is refused, or None: it is when a setting of
    ``fixed`` changed. The words name each such setting, both values, and how to go on."""
    refused = [(name, old, new) for name, old, new in changes if name in fixed]
    if not refused:
        return None
    named = "; ".join(f"{name}: {old} in {where}, {new} in the config" for name, old, new in refused)
    back = ", ".join(f"{name} = {old}" for name, old, _ in refused)
    return (
        f"resume refused, settings changed since the checkpoint ({named}): a checkpoint resumes only under the "
        f"{', '.join(n for n, _, _ in refused)} it was written with. Either set {back} again to resume, or start "
        "the cluster fresh with the new settings (move the old checkpoints out of the checkpoint directory and "
        "start every node without --resume)"
    )
