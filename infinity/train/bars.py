"""Progress bars of the slow parts before and after training (tokenizing, loading the model,
exporting) on stderr, shown once a part has lasted `DELAY_S`: a quick one stays silent."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

DELAY_S = 1.0


def bar(iterable: Iterable[Any] | None = None, *, desc: str, shown: bool, **options: Any) -> tqdm:
    return tqdm(iterable, desc=desc, disable=not shown, delay=DELAY_S, leave=False,
                file=sys.stderr, dynamic_ncols=True, **options)
