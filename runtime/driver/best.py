"""spec.evaluation.keepBest: the student of the best held-out evaluation, exported beside the last
one as <checkpoint.path>/student-hf-best.

Before an evaluation starts, the driver exports the weights it evaluates (those of its step, which
the trainer still holds) to a candidate folder <checkpoint.path>/.student-hf-eval-<step>. When the
evaluation's headline score is the best so far, the candidate replaces student-hf-best (renames,
so a reader sees the old folder or the new one); otherwise it is deleted. student-hf-best holds
kubedistill-eval.json ({step, weightVersion, score}), so a restarted trainer compares against it.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

from kubedistill.runtime.driver.evaluation import EvalResult

log = logging.getLogger("kubedistill.driver.best")

BEST_DIR = "student-hf-best"
EVAL_META = "kubedistill-eval.json"
CANDIDATE_PREFIX = ".student-hf-eval-"


def better(score: float | None, best: float | None) -> bool:
    """Whether `score` beats `best` (a tie keeps the earlier one; no score never wins)."""
    return score is not None and (best is None or score > best)


class BestKeeper:
    """The folder of the best evaluation's export under `root` and its candidates."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.best: float | None = None
        """The best headline score so far (read back from student-hf-best after a restart)."""
        try:
            self.best = json.loads((self.root / BEST_DIR / EVAL_META).read_text())["score"]
        except (OSError, ValueError, KeyError, TypeError):
            self.best = None
        for old in self.root.glob(CANDIDATE_PREFIX + "*"):  # left by a run that stopped mid-evaluation
            shutil.rmtree(old, ignore_errors=True)

    def candidate(self, step: int) -> Path:
        """Where the weights evaluated at `step` are exported."""
        return self.root / f"{CANDIDATE_PREFIX}{step:08d}"

    def finished(self, result: EvalResult) -> bool:
        """Keep the candidate of `result` as the best, or delete it; True when it became the best."""
        candidate = self.candidate(result.step)
        if not candidate.is_dir():
            return False
        if not better(result.score, self.best):
            shutil.rmtree(candidate, ignore_errors=True)
            return False
        meta = {"step": result.step, "weightVersion": result.weight_version, "score": result.score}
        (candidate / EVAL_META).write_text(json.dumps(meta))
        best = self.root / BEST_DIR
        old = self.root / f".{BEST_DIR}-old-{uuid.uuid4().hex[:8]}"
        if best.exists():
            best.rename(old)
        candidate.rename(best)
        shutil.rmtree(old, ignore_errors=True)
        log.info("held-out score %.4f at step %d is the best so far: exported to %s", result.score, result.step, best)
        self.best = result.score
        return True
