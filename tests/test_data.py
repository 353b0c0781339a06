"""The sampler's guarantees: order from (seed, epoch) only, steps cut into micro-batches without
changing which samples form them, resumable mid-epoch; and the DataLoader paths."""

import re

import pytest
import torch
from torch.utils.data import Dataset

from orchestrator.config import DataLoading
from trainables.data import Batches, DatasetTooSmall, SampleError, Shard, StepCut, StepSampler, eval_batch_sizes, eval_loader, train_loader
from trainables.mlp import MLPWorkload


def steps_of(sampler: StepSampler) -> list[list[int]]:
    """The sampler's micro-batches regrouped into optimizer steps."""
    per_step = len(sampler.cut.sizes)
    batches = list(sampler)
    return [sum(batches[i : i + per_step], []) for i in range(0, len(batches), per_step)]


def test_a_step_is_cut_into_full_micro_batches_and_a_remainder():
    assert StepCut(32, 8).sizes == (8, 8, 8, 8)
    assert StepCut(28, 8).sizes == (8, 8, 8, 4)
    assert StepCut(5, 16).sizes == (5,)


def test_replanning_changes_the_cut_not_the_samples_of_a_step():
    whole, cut = StepSampler(100, StepCut(24, 24), seed=3), StepSampler(100, StepCut(24, 10), seed=3)
    for epoch in (0, 1):
        whole.set_position(epoch, 0)
        cut.set_position(epoch, 0)
        assert steps_of(whole) == steps_of(cut)
        assert [len(b) for b in list(cut)[:3]] == [10, 10, 4]
    assert len(steps_of(whole)) == 4  # 100 // 24: the last partial step is dropped


def test_an_epoch_order_depends_only_on_seed_and_epoch():
    a, b = StepSampler(64, StepCut(16, 8), seed=1), StepSampler(64, StepCut(16, 8), seed=1)
    a.set_position(2, 0)
    list(StepSampler(64, StepCut(16, 8), seed=1))  # other samplers drawing in between change nothing
    b.set_position(2, 0)
    assert list(a) == list(b)
    b.set_position(3, 0)
    assert list(a) != list(b)
    assert sorted(sum(list(a), [])) == list(range(64))  # a permutation: every sample once per epoch


def test_a_resumed_epoch_continues_where_it_stopped():
    sampler = StepSampler(80, StepCut(16, 4), seed=0)
    sampler.set_position(1, 0)
    full = steps_of(sampler)
    sampler.set_position(1, 3)
    assert steps_of(sampler) == full[3:] and len(sampler) == (5 - 3) * 4


def test_an_ordered_epoch_is_parallel_streams_in_the_batchify_layout():
    """Row j of step s is sample s of stream j (contiguous runs of 25 samples), whatever the
    cut, the seed or the epoch; in a group, each rank takes its own consecutive streams."""
    sampler = StepSampler(100, StepCut(4, 4), seed=0, ordered=True)
    steps = steps_of(sampler)
    assert len(steps) == 25 and steps[0] == [0, 25, 50, 75] and steps[1] == [1, 26, 51, 76]
    for cut, seed, epoch in ((StepCut(4, 1), 0, 0), (StepCut(4, 3), 5, 2)):
        other = StepSampler(100, cut, seed=seed, ordered=True)
        other.set_position(epoch, 0)
        assert steps_of(other) == steps
    assert list(StepSampler(100, StepCut(4, 3), seed=0, ordered=True))[:2] == [[0, 25, 50], [75]]
    resumed = StepSampler(100, StepCut(4, 2), seed=0, ordered=True)
    resumed.set_position(0, 7)
    assert steps_of(resumed) == steps[7:]
    ranks = [steps_of(StepSampler(100, StepCut(2, 1), seed=0, shard=Shard(r, 2), ordered=True)) for r in (0, 1)]
    assert [a + b for a, b in zip(*ranks)] == steps


def test_a_stateful_workloads_loader_is_ordered():
    from trainables.examples.lstm_lm import LSTMLanguageModelWorkload

    workload = LSTMLanguageModelWorkload(train_tokens=1025, bptt=16)  # 64 windows: 4 streams of 16
    loader, _ = train_loader(workload, workload.train_data(), StepCut(4, 2), 0, DataLoading(), on_gpu=False)
    first, _, third = list(loader)[:3]
    stream = workload.tokens(1025, "train")
    assert torch.equal(first[0][1], stream[16 * 16 : 17 * 16])  # row 1: stream 1's first window
    assert torch.equal(third[0][1], stream[17 * 16 : 18 * 16])  # row 1 of the next step: its second
    assert torch.equal(first[1][0], stream[1:17])  # the targets: the next tokens


class Ragged(Dataset):
    """Sequences of different lengths: only a padding collate can batch them."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.arange(i % 7 + 1, dtype=torch.float32), i % 2


class PaddedWorkload(MLPWorkload):
    def collate(self, samples):
        longest = max(len(x) for x, _ in samples)
        x = torch.zeros(len(samples), longest)
        for row, (seq, _) in enumerate(samples):
            x[row, : len(seq)] = seq
        return {"x": x, "y": torch.tensor([y for _, y in samples])}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_uses_the_workload_collate_in_its_workers(workers):
    settings = DataLoading(num_workers=workers, prefetch_factor=2 if workers else None)
    loader, sampler = train_loader(PaddedWorkload(), Ragged(), StepCut(8, 4), seed=0, settings=settings, on_gpu=False)
    batches = list(loader)
    assert len(batches) == len(sampler) == 10
    assert all(b["x"].shape[0] == 4 and b["x"].shape[1] <= 7 for b in batches)
    indices = sum(list(sampler), [])
    assert sorted(int(y) for b in batches for y in b["y"]) == sorted(i % 2 for i in indices)


class Parents(Dataset):
    """Each sample is the id of the process that loaded it and of that process's parent."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import os

        return torch.tensor([float(os.getpid()), float(os.getppid())]), 0


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_loader_workers_fork_from_the_trials_process_unless_told_otherwise(method):
    """A fork server's workers are not this process's children (the setting for a process whose
    threads a fork would leave a child deadlocked on; see ``trainables.worker_start``)."""
    import os

    given = {} if method == "fork" else {"multiprocessing_context": method}
    settings = DataLoading(num_workers=2, **given)
    loader, _ = train_loader(PaddedWorkload(), Parents(), StepCut(4, 4), seed=0, settings=settings, on_gpu=False)
    loaded = torch.cat([b["x"] for b in Batches(loader, "train_data")])
    pids, parents = {int(p) for p in loaded[:, 0]}, {int(p) for p in loaded[:, 1]}
    assert os.getpid() not in pids and len(parents) == 1
    assert (parents == {os.getpid()}) == (method == "fork")


class HoldsAFile(Ragged):
    """A dataset that keeps a file open: a forked worker shares it, a pickled copy cannot."""

    def __init__(self, path):
        self.file = open(path, "rb")  # noqa: SIM115 - held for the dataset's life


class Reopens(Ragged):
    """A dataset that reopens its file when unpickled, as a worker that gets it pickled does."""

    def __init__(self, path):
        self.path = path

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.file = open(self.path + ".index", "rb")  # noqa: SIM115 - a bug: no such file


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_dataset_that_cannot_be_pickled_or_unpickled_is_named_with_the_setting_that_takes_it(tmp_path, method):
    """Before any worker starts: a worker that fails to unpickle it is only a traceback on stderr
    and a worker gone, which reads as one lost to host memory."""
    (tmp_path / "shards").write_bytes(b"x")
    settings = DataLoading(num_workers=2, multiprocessing_context=method)
    start = f"train_data: data.multiprocessing_context {method} pickles the dataset and the workload's collate for each " \
            "DataLoader worker, and they cannot be pickled and unpickled ("
    end = "); define their classes and functions at a module's top level and open files in the worker, or set " \
          "data.multiprocessing_context: fork"
    for dataset, why in ((HoldsAFile(tmp_path / "shards"), "TypeError: cannot pickle '_io.BufferedReader' object"),
                         (Reopens(str(tmp_path / "shards")), r"tests/test_data.py:\d+: FileNotFoundError: .*shards.index'")):
        loader, _ = train_loader(PaddedWorkload(), dataset, StepCut(8, 4), seed=0, settings=settings, on_gpu=False)
        with pytest.raises(SampleError) as err:
            Batches(loader, "train_data")
        assert re.fullmatch(re.escape(start) + why + re.escape(end), str(err.value)), str(err.value)
        assert err.value.__cause__ is not None
    forked = DataLoading(num_workers=2, multiprocessing_context="fork")
    loader, _ = train_loader(PaddedWorkload(), HoldsAFile(tmp_path / "shards"), StepCut(8, 4), seed=0,
                             settings=forked, on_gpu=False)
    assert len(list(Batches(loader, "train_data"))) == 10


class ManyTensors(Ragged):
    """Each sample its own tensor, as a list of tokenized sequences or of graphs holds them."""

    def __init__(self):
        self.samples = [torch.arange(i % 7 + 1, dtype=torch.float32) for i in range(300)]

    def __len__(self):
        return 300


def test_a_dataset_of_more_tensors_than_a_fork_server_passes_is_named_with_the_setting_that_takes_it():
    settings = DataLoading(num_workers=1, multiprocessing_context="forkserver")
    loader, _ = train_loader(PaddedWorkload(), ManyTensors(), StepCut(8, 4), seed=0, settings=settings, on_gpu=False)
    with pytest.raises(SampleError) as err:
        Batches(loader, "train_data")
    assert str(err.value) == (
        "train_data: data.multiprocessing_context forkserver sends each tensor of the dataset to a DataLoader worker "
        "as a file descriptor, and this one holds more than it passes (ValueError: too many fds); keep the samples "
        "in fewer, larger tensors, or set data.multiprocessing_context: fork")


def test_the_eval_loader_visits_every_sample_once_in_order():
    batches = list(eval_loader(PaddedWorkload(), Ragged(), 16, DataLoading(), on_gpu=False))
    assert [b["x"].shape[0] for b in batches] == eval_batch_sizes(40, 16) == [16, 16, 8]


def test_a_dataset_shorter_than_one_step_is_refused_by_name():
    with pytest.raises(DatasetTooSmall, match="PaddedWorkload: train_data has 40 samples, fewer than one optimizer step"):
        train_loader(PaddedWorkload(), Ragged(), StepCut(64, 8), seed=0, settings=DataLoading(), on_gpu=False)


def test_an_eval_set_smaller_than_the_ranks_is_refused_by_name():
    """Rank r evaluates the r-th contiguous slice; with fewer samples than ranks some slice is empty."""
    few = torch.utils.data.TensorDataset(torch.zeros(1, 4))
    with pytest.raises(DatasetTooSmall, match="MLPWorkload: eval_data has 1 samples, fewer than the 2 ranks that share it"):
        eval_loader(MLPWorkload(), few, 16, DataLoading(), on_gpu=False, shard=Shard(0, 2))


class CorruptAt(Dataset):
    """Ragged samples, one of which cannot be loaded."""

    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode sample {i}")
        return torch.arange(i % 7 + 1, dtype=torch.float32), i % 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_cannot_be_loaded_is_named_with_the_users_line(workers):
    """In a DataLoader worker too: the sample is found again in this process, with its frames."""
    settings = DataLoading(num_workers=workers, prefetch_factor=2 if workers else None)
    loader, sampler = train_loader(PaddedWorkload(), CorruptAt(bad=13), StepCut(8, 4), seed=0, settings=settings,
                                   on_gpu=False)
    batches = Batches(loader, "train_data")
    with pytest.raises(SampleError) as err:
        for _ in batches:
            pass
    assert str(err.value).startswith("train_data sample 13: tests/test_data.py:")
    assert str(err.value).endswith(": ValueError: cannot decode sample 13")
    assert isinstance(err.value.__cause__, ValueError)  # the user's exception, with its traceback
    assert 13 in list(sampler)[batches.taken]  # the batch it was asked for


def test_a_collate_that_fails_names_the_batchs_samples():
    class BrokenCollate(PaddedWorkload):
        def collate(self, samples):
            raise RuntimeError("ragged")

    batches = Batches(eval_loader(BrokenCollate(), Ragged(), 16, DataLoading(), on_gpu=False), "eval_data")
    with pytest.raises(SampleError, match=r"^collate of eval_data samples 0, 1, 2, 3, 4, 5, 6, 7, \.\.\. "
                                          r"\(16 in all\): tests/test_data.py:\d+: RuntimeError: ragged$"):
        next(batches)


def test_a_failure_that_does_not_happen_again_is_raised_as_it_came():
    """Not pinned on the data: a DataLoader worker that died, say (here: the first fetch only)."""
    class FlakyOnce(Ragged):
        failed = False

        def __getitem__(self, i):
            if not FlakyOnce.failed:
                FlakyOnce.failed = True
                raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")
            return super().__getitem__(i)

    batches = Batches(eval_loader(PaddedWorkload(), FlakyOnce(), 16, DataLoading(), on_gpu=False), "eval_data")
    with pytest.raises(RuntimeError, match="is killed by signal"):
        next(batches)
