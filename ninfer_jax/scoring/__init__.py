"""The CausalScoring purpose (DESIGN §9): per-token log-probs, sums, greedy flags, perplexity.

`Scorer` is the notebook API; `CausalScoreCore` plans windows and runs them on its
`ScoringProgram` (`program/scoring.py`), one call after another;
`rolling_windows` is the window plan (lm-evaluation-harness `loglikelihood_rolling` semantics).
"""

from ninfer_jax.scoring.core import (
    CausalScoreCore,
    Occupancy,
    ScoreInputError,
    ScoreRequest,
    ScoringConfig,
    TokenScores,
    WindowKey,
)
from ninfer_jax.scoring.scorer import Scorer, ScoreResult
from ninfer_jax.scoring.windows import Window, rolling_windows

__all__ = ["CausalScoreCore", "Occupancy", "ScoreInputError", "ScoreRequest", "ScoreResult", "Scorer",
           "ScoringConfig", "TokenScores", "Window", "WindowKey", "rolling_windows"]
