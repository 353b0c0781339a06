"""The examples of ``trainables/examples`` and their sweeps in ``configs/``.

Unit tests check what each example's batching promises (graphs stay apart in a batch, padding
is masked out of the loss, the largest sample bounds every sample) and that the stateful LSTM
makes a plain PyTorch TBPTT loop's losses. The integration tests plan
and run each example's sweep, cut to one short trial, with the *installed* ``orchestrator``
command from a folder outside the repository, and read the results back from MLflow: the
graph example with this venv's command, the transformers and timm ones with ``.venv-zoo``'s
(torchvision does not work with the main venv's torch; ``bash scripts/setup.sh --zoo`` makes it).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from orchestrator.config import Every, Stop
from orchestrator.device import CpuDevice
from orchestrator.memory import estimate
from tests.conftest import ROOT
from trainables.carry import StateShapeError
from trainables.loop import LoopPlan, LoopSettings, Trainer
from trainables.examples.causal_lm import IGNORE, PAD, CausalLMWorkload, pad_batch
from trainables.examples.graphs import Graph, GraphWorkload, collate_graphs
from trainables.examples.lstm_lm import LSTMLanguageModelWorkload

MAIN_BIN = Path(sys.executable).parent
ZOO_BIN = ROOT / ".venv-zoo" / "bin"
needs_zoo = pytest.mark.skipif(
    not (ZOO_BIN / "orchestrator").exists(),
    reason=f"{ZOO_BIN.parent} not found: the transformers/timm examples run in their own venv "
    "(`bash scripts/setup.sh --zoo`), because torchvision does not work with the main venv's torch",
)


# -- graphs -----------------------------------------------------------------------------------


def small_graph(nodes: int, edges: list[tuple[int, int]], label: int, seed: int) -> Graph:
    x = torch.randn(nodes, 8, generator=torch.Generator().manual_seed(seed))
    pairs = torch.tensor(edges).T
    return Graph(x, torch.cat([pairs, pairs.flip(0)], dim=1), label)


def test_a_graph_batch_keeps_its_graphs_apart():
    """Batched, every graph gets the logits it gets alone: edges were offset to its own nodes
    and the read-out pooled only its nodes."""
    graphs = [
        small_graph(3, [(0, 1), (1, 2)], 0, seed=1),
        small_graph(5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)], 1, seed=2),
        small_graph(2, [(0, 1)], 2, seed=3),
    ]
    batch = collate_graphs(graphs)
    assert batch.x.shape == (10, 8) and batch.edge_index.shape == (2, 2 * (2 + 5 + 1))
    assert batch.graph.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2] and batch.y.tolist() == [0, 1, 2]
    assert batch.edge_index[:, 4:14].min() == 3 and batch.edge_index[:, 4:14].max() == 7  # graph 1: nodes 3..7

    workload = GraphWorkload(width=16, layers=2)
    torch.manual_seed(0)
    model = workload.build_model().eval()
    together = model(batch)
    alone = torch.cat([model(collate_graphs([g])) for g in graphs])
    torch.testing.assert_close(together, alone)


def test_the_largest_graph_has_the_most_nodes_and_edges_of_any():
    workload = GraphWorkload(train_graphs=200, eval_graphs=50)
    largest = workload.largest_sample()
    graphs = workload.train_data().graphs + workload.eval_data().graphs
    assert largest.x.shape[0] == max(g.x.shape[0] for g in graphs)
    assert largest.edge_index.shape[1] == max(g.edge_index.shape[1] for g in graphs)
    assert len({g.x.shape[0] for g in graphs}) > 10  # sizes really vary
    assert largest.edge_index.max() < largest.x.shape[0]


# -- causal LM (data and batching need no transformers) -------------------------------------


def test_sequences_are_padded_to_the_longest_and_padding_is_not_a_label():
    batch = pad_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, PAD, PAD], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, 7, IGNORE, IGNORE], [8, 9, 10, 11, 12]]


def test_the_largest_sequence_is_as_long_as_any_and_the_first_is_shorter():
    """So a plan from the first sample (the default largest_sample) would be too small."""
    workload = CausalLMWorkload(min_length=8, max_length=40, train_sequences=300, eval_sequences=50)
    lengths = [len(s) for s in workload.train_data().sequences + workload.eval_data().sequences]
    assert min(lengths) == 8 and max(lengths) == 40
    assert len(workload.train_data()[0]) < 40 == len(workload.largest_sample())
    assert all(PAD not in s for s in workload.train_data().sequences)


def test_padding_adds_nothing_to_the_eval_sums():
    pytest.importorskip("transformers")
    workload = CausalLMWorkload(architecture="llama", max_length=16)
    torch.manual_seed(0)
    model = workload.build_model().eval()
    short, long = torch.randint(1, 256, (5,)), torch.randint(1, 256, (12,))
    alone = [workload.eval_metrics(model, pad_batch([s]), 1) for s in (short, long)]
    together = workload.eval_metrics(model, pad_batch([short, long]), 2)
    torch.testing.assert_close(together["nll"], alone[0]["nll"] + alone[1]["nll"], rtol=1e-4, atol=1e-4)
    assert together["tokens"] == 4 + 11


def test_lm_micro_batches_of_varying_lengths_make_the_whole_batch_update():
    """The loss is a mean over sequences, so cutting a step of 8 sequences into 3 + 3 + 2
    (each padded to its own longest) updates the weights as the uncut step does."""
    pytest.importorskip("transformers")
    workload = CausalLMWorkload(architecture="llama", layers=1, hidden=32, min_length=4, max_length=24,
                                train_sequences=32, eval_sequences=8, lr=0.01)
    settings = LoopSettings(Stop(steps=2))
    trained = []
    for micro_batch in (8, 3):
        device = CpuDevice()
        with device.measuring():
            trainer = Trainer(workload, device, LoopPlan(micro_batch, 8, 8), settings)
            list(trainer.run())
        trained.append([p.detach().clone() for p in trainer.model.parameters()])
    for whole, cut in zip(*trained):
        torch.testing.assert_close(whole, cut, rtol=1e-4, atol=1e-5)


# -- the stateful LSTM language model (truncated BPTT) -----------------------------------------


def lstm_workload(**extra) -> LSTMLanguageModelWorkload:
    return LSTMLanguageModelWorkload(**{"vocab": 16, "hidden": 16, "layers": 2, "bptt": 8, "train_tokens": 1025,
                                        "eval_tokens": 129, "lr": 0.02, **extra})  # 128 windows of 8 tokens


def plain_tbptt_losses(workload: LSTMLanguageModelWorkload, batch_size: int, epochs: int, seed: int = 0,
                       carry: bool = True) -> list[float]:
    """The usual PyTorch TBPTT loop (``word_language_model``'s shape): batchify the token stream
    into ``batch_size`` rows, walk it ``bptt`` tokens at a time, detach the hidden state between
    steps, start each epoch from zeros. Each step's loss. ``carry=False``: zeros at every step."""
    torch.manual_seed(seed)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    tokens, bptt = workload.tokens(workload.train_tokens, "train"), workload.bptt
    steps = (len(tokens) - 1) // bptt // batch_size
    length = batch_size * steps * bptt
    inputs, targets = tokens[:length].view(batch_size, -1), tokens[1 : length + 1].view(batch_size, -1)
    losses = []
    for _ in range(epochs):
        hidden = workload.initial_state(batch_size)
        for i in range(0, steps * bptt, bptt):
            hidden = tuple(h.detach() for h in hidden) if carry else workload.initial_state(batch_size)
            logits, hidden = model(inputs[:, i : i + bptt], hidden)
            loss = F.cross_entropy(logits.flatten(0, 1), targets[:, i : i + bptt].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


#: A milestone (and its train loss) after every step, one evaluation at the end.
EVERY_STEP = {"eval_every": Every("epochs", 100), "checkpoint_every": Every("steps", 1)}


def trainer_losses(trainer: Trainer, steps: int | None = None) -> list[float]:
    run = trainer.run()
    return [next(run).train_loss for _ in range(steps)] if steps else [m.train_loss for m in run]


def lstm_trainer(workload, micro_batch: int, epochs: int = 2, batch: int = 8) -> Trainer:
    return Trainer(workload, CpuDevice(), LoopPlan(micro_batch, batch, 32), LoopSettings(Stop(epochs=epochs), **EVERY_STEP))


@pytest.mark.parametrize("micro_batch, tolerance", [(8, 1e-6), (3, 1e-5)], ids=["whole", "accumulated-3-3-2"])
def test_the_lstm_lm_makes_the_plain_tbptt_loops_losses(micro_batch, tolerance):
    """Step for step over two epochs (16 steps each): the ordered streams, the carried and
    detached state and the per-epoch reset are the plain loop's; micro-batches of 3 + 3 + 2
    streams each carry their own rows of the state."""
    workload = lstm_workload()
    plain = plain_tbptt_losses(workload, batch_size=8, epochs=2)
    ours = trainer_losses(lstm_trainer(workload, micro_batch))
    assert len(ours) == len(plain) == 32
    torch.testing.assert_close(ours, plain, rtol=tolerance, atol=tolerance)
    assert plain[-1] < 0.9 * plain[0]  # it learns
    forgetful = plain_tbptt_losses(workload, batch_size=8, epochs=2, carry=False)
    assert max(abs(a - b) for a, b in zip(forgetful, plain)) > 100 * tolerance  # the carried state shows


def test_a_mid_epoch_resume_continues_the_streams_with_their_state_even_re_cut():
    """A checkpoint at step 11 of 16 (through torch.save, as a trial's), resumed as it was and,
    as after an OOM reduction, with micro-batches of 2 instead of 8: the same rows of the same
    state continue, and the losses are the uninterrupted loop's."""
    workload = lstm_workload()
    plain = plain_tbptt_losses(workload, batch_size=8, epochs=2)
    first = lstm_trainer(workload, 8)
    before = trainer_losses(first, 11)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    for micro_batch in (8, 2):
        buffer.seek(0)
        resumed = lstm_trainer(workload, micro_batch)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        assert resumed.carry.state[0].abs().sum() > 0  # the state of step 11, not zeros
        torch.testing.assert_close(before + trainer_losses(resumed), plain, rtol=1e-5, atol=1e-5)


def test_a_checkpointed_state_for_other_streams_is_refused():
    workload = lstm_workload()
    state = lstm_trainer(workload, 8).state_dict()
    with pytest.raises(StateShapeError, match="checkpoint's carried state.*16 rows"):
        lstm_trainer(workload, 8, batch=16).load_state_dict(state)


def test_the_lstm_lm_is_traced_with_its_state_as_the_real_cpu_run_measures():
    """The step traced on fake tensors with a fake state of the step's rows (no fallback), byte
    for byte as real CPU steps measure at the probe both take (b=2). (Between probes the LSTM's
    oneDNN workspace is padded, not linear in b: see tests/test_memory_trace.py.)"""
    workload = lstm_workload()
    traced = estimate(workload, "trace", target="cpu")
    real = estimate(workload, "measured", target="cpu", device=CpuDevice())
    assert traced.estimator == "trace" and not any("impossible" in n for n in traced.notes), traced.notes
    (fake_train, fake_eval), (real_train, real_eval) = traced.phases, real.phases
    assert fake_eval.allocated_at(2) == real_eval.allocated_at(2)
    assert fake_train.allocated_at(2) == real_train.allocated_at(2)


# -- the sweeps, planned and run --------------------------------------------------------------


def orchestrator(bin_dir: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The installed command of ``bin_dir``'s venv, found by nothing but that venv's PATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run([str(bin_dir / "orchestrator"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def plan(bin_dir: Path, config: str, overrides: list[str], cwd: Path) -> list[dict]:
    """Every trial of ``orchestrator plan --json``, after checking each was traced (no fallback)."""
    proc = orchestrator(bin_dir, ["plan", str(ROOT / "configs" / config), "--json", *sets(overrides)], cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trials = json.loads(proc.stdout)["trials"]
    for trial in trials:
        assert trial["plan"]["estimator"] == "trace", trial["plan"]
        assert "trace impossible" not in trial["plan"]["note"], trial["plan"]["note"]
    return trials


def run(bin_dir: Path, config: str, overrides: list[str], cwd: Path) -> str:
    """The final table of a sweep that must finish."""
    proc = orchestrator(bin_dir, ["run", str(ROOT / "configs" / config), "--num-cpus", "2", *sets(overrides)], cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout[proc.stdout.rindex("\ntrial  ") + 1:]


def sets(overrides: list[str]) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def finished_trial(cwd: Path, experiment: str, metric: str, eval_steps: list[int]):
    """The sweep's one trial in MLflow (the SQLite store in ``cwd``): finished, ``metric`` logged
    at every evaluation, and its measured peak within the plan's prediction."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{cwd}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(trials) == 1
    trial = trials[0]
    assert trial.info.status == "FINISHED"
    history = client.get_metric_history(trial.info.run_id, metric)
    assert [m.step for m in history] == eval_steps
    metrics = trial.data.metrics
    # The plan was made for the worst batch: no batch the trial trained on needed more.
    assert metrics["prediction_error"] <= 0.01, metrics
    assert metrics["oom_retries"] == 0
    return trial, [m.value for m in history]


def table_row(table: str) -> list[str]:
    header, _, row = table.splitlines()[:3]
    return header, row


#: Each sweep cut to a few steps of one trial on less data; the plans are of the same cut.
GRAPHS_CUT = ["stop.steps=6", "eval_every.steps=3", "workload.params.train_graphs=512", "workload.params.eval_graphs=128"]
LM_CUT = ["stop.steps=4", "eval_every.steps=2", "workload.params.train_sequences=256", "workload.params.eval_sequences=32"]
IMAGES_CUT = ["stop.epochs=1", "eval_every.steps=2", "workload.params.train_images=256", "workload.params.eval_images=64"]


@pytest.mark.integration
def test_the_graph_sweep_plans_by_trace_and_reports_accuracy(tmp_path):
    trials = plan(MAIN_BIN, "example_graphs.yaml", GRAPHS_CUT, tmp_path)
    assert {t["config"]["width"] for t in trials} == {32, 64}
    table = run(MAIN_BIN, "example_graphs.yaml", ["search_space.width=32", "search_space.lr=0.003", *GRAPHS_CUT], tmp_path)
    header, row = table_row(table)
    assert "eval_accuracy" in header and "TERMINATED" in row and "1/1 trials finished" in table
    _, accuracy = finished_trial(tmp_path, "example_graphs", "eval_accuracy", [3, 6])
    assert all(0 <= a <= 1 for a in accuracy)


@pytest.mark.integration
@needs_zoo
def test_the_padded_lm_is_planned_for_its_longest_sequence_and_fits_the_emulated_device(tmp_path):
    """Sequences of 16..64 tokens are planned exactly as if all were 64 long; the trial then
    trains on an emulated device its plan fills, with no OOM."""
    one_trial = ["search_space.architecture=llama", "search_space.lr=0.003", *LM_CUT]
    varying, all_longest = plan(ZOO_BIN, "example_causal_lm.yaml", [*one_trial, "search_space.min_length={grid: [16, 64]}"],
                                tmp_path)
    assert varying["config"]["min_length"] == 16 and all_longest["config"]["min_length"] == 64
    assert varying["plan"] == all_longest["plan"] and varying["profile"] == all_longest["profile"]
    planned = varying["plan"]
    assert planned["micro_batch"] < planned["effective_batch"]  # the emulated device is what limits it

    table = run(ZOO_BIN, "example_causal_lm.yaml", one_trial, tmp_path)
    header, row = table_row(table)
    assert "eval_perplexity" in header and f"{planned['micro_batch']} x {planned['accum_steps']}" in row
    trial, perplexity = finished_trial(tmp_path, "example_causal_lm", "eval_perplexity", [2, 4])
    assert all(1 < p < 2 * 256 for p in perplexity)  # from about the vocabulary's size, down
    assert trial.data.metrics["micro_batch"] == planned["micro_batch"]


@pytest.mark.integration
@needs_zoo
def test_the_image_sweep_decodes_in_workers_and_reports_accuracy(tmp_path):
    trials = plan(ZOO_BIN, "example_images.yaml", ["search_space.lr=0.003", *IMAGES_CUT], tmp_path)
    assert {t["config"]["model"] for t in trials} == {"resnet10t", "mobilenetv3_small_050"}
    table = run(ZOO_BIN, "example_images.yaml", ["search_space.model=resnet10t", "search_space.lr=0.003", *IMAGES_CUT],
                tmp_path)
    header, row = table_row(table)
    assert "eval_accuracy" in header and "TERMINATED" in row
    _, accuracy = finished_trial(tmp_path, "example_images", "eval_accuracy", [2, 4])
    assert all(0 <= a <= 1 for a in accuracy)


LSTM_CUT = ["search_space.lr=0.01", "stop.steps=8", "eval_every.steps=4"]


@pytest.mark.integration
def test_the_stateful_lstm_sweep_is_traced_and_survives_an_oom_with_the_same_updates(tmp_path):
    """``plan`` traces the stateful LSTM (a fake state of the step's rows; no fallback). ``run``
    with no estimate starts at micro-batch 32 on the 4 MiB emulated device, runs out of memory,
    and finishes at a smaller micro-batch, each carrying its own streams' rows of the state:
    its eval perplexities are those of this process's trainer at micro-batch 32 on the CPU."""
    (trial,) = plan(MAIN_BIN, "lstm_tbptt_cpu.yaml", LSTM_CUT, tmp_path)
    assert trial["plan"]["micro_batch"] == 16 and trial["plan"]["accum_steps"] == 2

    table = run(MAIN_BIN, "lstm_tbptt_cpu.yaml", [*LSTM_CUT, "memory.estimator=none"], tmp_path)
    assert "TERMINATED" in table_row(table)[1] and "1/1 trials finished" in table
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("lstm_tbptt_cpu").experiment_id])
    (finished,) = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert finished.info.status == "FINISHED" and finished.data.metrics["oom_retries"] >= 1
    assert finished.data.metrics["micro_batch"] < 32
    history = client.get_metric_history(finished.info.run_id, "eval_perplexity")
    assert [m.step for m in history] == [4, 8]

    workload = LSTMLanguageModelWorkload(layers=2, hidden=64, bptt=16, train_tokens=32769, eval_tokens=4097, lr=0.01)
    settings = LoopSettings(Stop(steps=8), eval_every=Every("steps", 4), max_grad_norm=0.25)
    here = Trainer(workload, CpuDevice(), LoopPlan(32, 32, 128), settings)
    expected = [m.eval["eval_perplexity"] for m in here.run()]
    assert [m.value for m in history] == pytest.approx(expected, rel=1e-4)

