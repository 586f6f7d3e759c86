"""tools/resume_guard_study.py's smallest form: a tiny CPU run judged at each of its logged
steps as a clean resume; real resumes from its checkpoints (their losses equal the
uninterrupted run's bitwise) and of its end, extended past its schedule: no clean resume
stops, a model reset to chance is caught once the run has learned, and a checkpoint whose
weights, or only its output head, were halved (hashes rewritten) stops its resume."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_quick_study_no_clean_resume_stops_and_damage_is_caught(tmp_path, capsys):
    from tools import resume_guard_study as study

    quick = study.QUICK_RUNS, study.QUICK_RESUMED, study.RESUME_EVERY, study.QUICK_DAMAGE
    totals = study.study(tmp_path, *quick, study.QUICK_EXTEND_TO)
    out = capsys.readouterr().out
    assert totals["resumes"] == 10 and totals["stops"] == 0, out  # 7 judged + 3 real
    assert totals["real_bitwise"], out
    assert totals["z_max"] < 5, out  # below the guard's 5 noises
    assert totals["reset_judged"] >= 4 and totals["reset_caught"] == totals["reset_judged"], out
    assert out.count("checkpoint: resumed segment healthy: losses ") == 3, out
    assert "real resume from step 12 (extended past its schedule): checkpoint: resumed" in out
    # Each damaged checkpoint (step 8's) stopped its resume, in one line.
    assert totals["damage"] == {"weights x0.5": (1, 1), "output head x0.5": (1, 1)}, out
