"""Training settings every member of a cluster must share, and the words that name a disagreement.

A node declares its settings (strategy, period, codecs, model layout, ...) as short name -> value strings
once it attached a model; they travel in every handshake, and two nodes whose settings differ refuse each
other at once with a message naming each differing setting and both values, instead of starting rounds
that can only fail (a different ``period`` gives groups of different sizes) or silently diverge.
"""

from __future__ import annotations

from collections.abc import Mapping

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
