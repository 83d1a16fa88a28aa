"""How much of a stream's text to hold back because it may still grow into a stop string: streaming
it now would show text that the final, stop-trimmed answer no longer has."""

from __future__ import annotations


class StopHoldback:
    """An Aho-Corasick automaton over the stop strings, fed the stream's text as it grows. Its state
    is the longest suffix of the text that is a prefix of some stop string, which is exactly the
    holdback; each new character costs amortised constant work, however long the text is and
    however many (bounded) stop strings there are, so a token's cost does not grow with either."""

    def __init__(self, stops: list[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.children[node].get(ch)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][ch] = nxt
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                node = nxt
        self.fail = [0] * len(self.children)
        frontier = list(self.children[0].values())
        while frontier:
            level = []
            for node in frontier:
                for ch, child in self.children[node].items():
                    self.fail[child] = self._step(self.fail[node], ch)
                    level.append(child)
            frontier = level
        self.node = 0
        self.seen = 0

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self.children[node]:
            node = self.fail[node]
        return self.children[node].get(ch, 0)

    def update(self, text: str) -> int:
        """Holdback for `text`, which extends every text given before."""
        for ch in text[self.seen :]:
            self.node = self._step(self.node, ch)
        self.seen = len(text)
        return self.depth[self.node]
