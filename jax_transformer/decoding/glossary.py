"""A glossary (`translate --glossary terms.tsv`): lines `source term<TAB>target term`; wherever a source term occurs
in a sentence as whole words, its target term becomes a constraint of that sentence (`decoding.constraints`: a
phrase its translation must hold). The case rule: terms match regardless of case (Unicode case folding: "API",
"api" and "Api" are one term), whole words only ("cat" is not in "category"); every matching entry counts, a term
inside a longer one included, each target term once per sentence, in the glossary's order."""

from __future__ import annotations

import dataclasses
import os
import re

from jax_transformer.data.corpus import read_lines
from jax_transformer.errors import DataError


@dataclasses.dataclass(frozen=True)
class Glossary:
    entries: tuple[tuple[str, str], ...]  # (source term, target term), in the file's order

    def __post_init__(self) -> None:
        patterns = tuple(re.compile(rf"(?<!\w){re.escape(s.casefold())}(?!\w)") for s, _ in self.entries)
        object.__setattr__(self, "_patterns", patterns)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Glossary:
        """The glossary of a UTF-8 file; a DataError naming the file and line for a line that is not two non-empty
        tab-separated fields (a blank line is skipped), or a file with no entry."""
        entries = []
        for number, line in read_lines(path, origin=str(path)):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2 or not all(f.strip() for f in fields):
                raise DataError(
                    f"{path}, line {number}: expected 'source term<TAB>target term', two non-empty fields, got "
                    f"{line[:60]!r}"
                )
            entries.append((fields[0].strip(), fields[1].strip()))
        if not entries:
            raise DataError(f"{path}: no entries (lines of 'source term<TAB>target term')")
        return cls(tuple(entries))

    def terms(self, sentence: str) -> list[str]:
        """The target terms of the source terms that occur in `sentence`, each once, in the glossary's order."""
        folded, found = sentence.casefold(), []
        for (_, target), pattern in zip(self.entries, self._patterns):
            if target not in found and pattern.search(folded):
                found.append(target)
        return found

    def constraints(self, sentence: str, given: list[str] | None = None) -> list[str] | None:
        """`given` (a line's own constraints) and then the sentence's glossary terms not among them; None: none."""
        out = list(given or [])
        out += [term for term in self.terms(sentence) if term not in out]
        return out or None
