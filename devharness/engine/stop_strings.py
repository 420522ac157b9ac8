"""Stop-string search as the output grows, on the engine's thread: each new character costs a set lookup per stop
length (at most MAX_STOP_STRING_CHARS of them, config.py), never a scan of every stop string, so a request with many
stop strings does not hold up the step every other request waits on."""
from __future__ import annotations


class StopMatcher:
    """The stop strings of one request, bucketed by length."""

    def __init__(self, stops: list[str]):
        self.rank: dict[str, int] = {}   # each stop string's first place in the list: it breaks ties
        for i, s in enumerate(stops):
            self.rank.setdefault(s, i)
        self.lengths = sorted({len(s) for s in self.rank})
        self.longest = self.lengths[-1] if self.lengths else 0

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that starts first in `text` among those ending past `new_from`
        (that is, in or across the text added since the last search), the first listed of those starting there;
        None if none. `text` need reach back only `longest - 1` characters before `new_from`."""
        best: tuple[int, int, str] | None = None   # (start, rank, stop string)
        for end in range(new_from + 1, len(text) + 1):
            if best is not None and end - self.longest > best[0]:
                break   # whatever ends here or later starts after the best
            for n in self.lengths:
                if n > end:
                    break
                s = text[end - n:end]
                rank = self.rank.get(s)
                if rank is not None and (best is None or (end - n, rank) < best[:2]):
                    best = (end - n, rank, s)
        return None if best is None else (best[0], best[2])
