"""tools/resume_guard_study.py's smallest form: a tiny CPU run judged at each of its logged
steps as a clean resume, and 2 real resumes from its checkpoints (their losses equal the
uninterrupted run's bitwise): no clean resume stops, and a model reset to chance is caught
once the run has learned."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_quick_study_no_clean_resume_stops(tmp_path, capsys):
    from tools import resume_guard_study as study

    totals = study.study(tmp_path, study.QUICK_RUNS, study.QUICK_RESUMED, study.RESUME_EVERY)
    out = capsys.readouterr().out
    assert totals["resumes"] == 9 and totals["stops"] == 0, out  # 7 judged + 2 real
    assert totals["real_bitwise"], out
    assert totals["z_max"] < 5, out  # below the guard's 5 noises
    assert totals["reset_judged"] >= 4 and totals["reset_caught"] == totals["reset_judged"], out
    assert out.count("checkpoint: resumed segment healthy: losses ") == 2, out
