"""Continued BPE: learn merges on top of a base tokenizer's own segmentation of new-domain text.

Why not train a fresh BPE and keep the merges the base lacks: a fresh BPE starts from bytes, so
its later merges join pieces the base tokenizer never produces side by side (the base may split
"kato" as "k" + "ato", a fresh BPE as "ka" + "to"), and such a merge never fires. Here every
merge is counted on the base tokenizer's actual output (after the merges learned before it), so
each learned merge fires on the text it was learned from, in the order the extended tokenizer
applies it: appended merges rank below every base merge, so the base merges run to completion
first and the new ones then apply in learned order, exactly as simulated here.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable
from itertools import pairwise

Pair = tuple[str, str]


def _pairs(symbols: list[str]) -> Iterable[Pair]:
    return pairwise(symbols)


def _merge_word(symbols: list[str], pair: Pair) -> list[str]:
    """``symbols`` with every occurrence of ``pair`` merged, left to right and non-overlapping (as BPE applies it)."""
    merged, index = [], 0
    while index < len(symbols):
        if index + 1 < len(symbols) and (symbols[index], symbols[index + 1]) == pair:
            merged.append(symbols[index] + symbols[index + 1])
            index += 2
        else:
            merged.append(symbols[index])
            index += 1
    return merged


def learn_merges(
    words: Counter[tuple[str, ...]], count: int, known: set[str], frozen: set[str] = frozenset(), min_frequency: int = 2
) -> list[Pair]:
    """Up to ``count`` merges, most frequent pair first, each making a token that is not in ``known``.

    Args:
        words: each word's segmentation by the base tokenizer (its tokens' strings) -> how often it occurs.
        count: how many merges to learn; fewer are returned when no pair occurs ``min_frequency`` times.
        known: the base vocabulary's token strings; a pair whose merge is already a token is never taken
            (it would change how the base segments without adding a token).
        frozen: tokens never merged (added/special tokens, byte-fallback tokens).
        min_frequency: a merge must occur at least this often in ``words``.

    Ties go to the lexicographically smallest pair, so the result depends on the text alone.
    """
    symbols = [list(word) for word in words]
    freq = list(words.values())
    counts: Counter[Pair] = Counter()
    where: dict[Pair, set[int]] = defaultdict(set)
    for index, word in enumerate(symbols):
        for pair in _pairs(word):
            counts[pair] += freq[index]
            where[pair].add(index)
    heap = [(-n, a, b) for (a, b), n in counts.items()]
    heapq.heapify(heap)
    known = set(known)
    merges: list[Pair] = []
    while heap and len(merges) < count:
        negative, a, b = heapq.heappop(heap)
        pair = (a, b)
        if counts.get(pair, 0) != -negative:
            continue  # a stale entry: the pair's count changed since it was pushed
        if -negative < min_frequency:
            break
        if a in frozen or b in frozen or a + b in known:
            continue  # never taken; its count is not pushed again unless it changes
        merges.append(pair)
        known.add(a + b)
        changed: set[Pair] = set()
        for index in where.pop(pair, ()):
            word, n = symbols[index], freq[index]
            merged = symbols[index] = _merge_word(word, pair)
            delta = Counter(_pairs(merged))
            delta.subtract(_pairs(word))
            for p, d in delta.items():
                if d:
                    counts[p] += d * n
                    changed.add(p)
                    if d > 0:
                        where[p].add(index)
        for p in changed:
            if counts[p] > 0:
                heapq.heappush(heap, (-counts[p], *p))
            else:
                counts.pop(p, None)
    return merges
