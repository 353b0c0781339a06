"""The library zoo (``bench.zoo.LIBRARY_ZOO``: timm, torchvision, transformers, torch.nn) through
the installed ``orchestrator plan`` of ``.venv-zoo``, as a user plans a GPU sweep from a machine
without one: every model traces on fake tensors with CUDA emulated, with no fallback, and the one
that cannot be traced (a detector) says which op stopped it, in which file and line.

One plan per precision over a grid of every zoo model, so the libraries load once.
``bash scripts/setup.sh --zoo`` makes ``.venv-zoo`` (``scripts/test.sh`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict

import pytest

from bench.zoo import LIBRARY_ZOO
from tests.conftest import ROOT

ORCHESTRATOR = ROOT / ".venv-zoo" / "bin" / "orchestrator"
#: What a note says when the trace did not run as on the GPU: the estimate is not a trace.
FALLBACKS = ("trace impossible", "fell back", "math kernel", "not counted")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not ORCHESTRATOR.exists(), reason=".venv-zoo is missing: make it with bash scripts/setup.sh --zoo"),
]


def plan(tmp_path, precision: str, entries) -> dict:
    names = [e.import_path for e in entries]
    config = tmp_path / f"zoo_{precision}.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "experiment": f"zoo_{precision}",
        "workload": {"name": names[0]},
        "search_space": {"workload": {"grid": names}},
        "effective_batch_size": 64,
        "stop": {"epochs": 1},
        "memory": {"estimator": "trace", "precision": precision},
    }))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [str(ORCHESTRATOR), "plan", str(config), "--device-memory", "24GiB", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_every_zoo_model_traces_for_a_cuda_target_or_names_the_op_that_stops_it(tmp_path):
    by_precision = defaultdict(list)
    for entry in LIBRARY_ZOO:
        by_precision[entry.precision].append(entry)
    entries = {e.import_path: e for e in LIBRARY_ZOO}
    problems = []
    for precision, group in by_precision.items():
        for trial in plan(tmp_path, precision, group)["trials"]:
            entry = entries[trial["config"]["workload"]]
            if "error" in trial:
                problems.append(f"{entry.name}: {trial['error']}")
                continue
            profile = trial["profile"]
            if entry.untraceable is None:
                fallbacks = [n for n in profile["notes"] if any(f in n for f in FALLBACKS)]
                if profile["estimator"] != "trace" or fallbacks:
                    problems.append(f"{entry.name}: {profile['estimator']}: {fallbacks}")
                assert trial["plan"]["micro_batch"] >= 1, entry.name
            else:  # the op, and the library file and line where the model called it
                reason = profile["notes"][0]
                if not (profile["estimator"] == "static" and reason.startswith("trace impossible (aten.")
                        and f"{entry.untraceable}/" in reason and ".py:" in reason):
                    problems.append(f"{entry.name}: expected the op and frame that stop the trace, got {reason}")
    assert not problems, "\n".join(problems)
