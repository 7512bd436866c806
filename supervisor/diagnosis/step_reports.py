"""Progress read from a trainer's own output: a heartbeat for trainers that cannot be edited.

verl, AReaL and Megatron-Bridge never call ``trainer_hooks``, but every one of them prints its step
on every logged iteration. With ``progress`` (a preset) or ``progress_regex``, output lines that
match are read for the step (the ``step`` group, else the first group). The heartbeat is written as a
job-level record (rank :data:`JOB_RANK`, the job's root pid) into the attempt's heartbeat directory,
in the same format the ranks use, so everything that reads heartbeats works unchanged: the learned
timeout, hang detection with stacks (py-spy: nothing is needed in the trainer), the no-progress guard,
``rlsup_last_step``, incidents and ``rlsup status``. Where ranks heartbeat through ``trainer_hooks``
too, theirs take precedence (:func:`speaking_records`).

Lines are matched as the output arrives, split at ``\\n`` and at ``\\r`` (a tqdm bar redraws itself
with ``\\r`` and ends its line only when done). What counts (:class:`StepTracker`):

- a **beat** only when a training step moved past the highest step of the attempt: a redraw of the
  same step (tqdm redraws for a new postfix, a log line written above the bar, or its monitor thread
  after 10 s) or a lower step (another bar, a restart inside the output) is not one, and neither
  refreshes the beat time nor feeds the learned timeout. The step reported is therefore the highest
  training step the attempt printed;
- a bar that is not the training loop's (:data:`NOT_TRAINING`, a bar nested under the training bar,
  another bar of the same shape) is never a step; when it moves the job is doing something else
  (saving, evaluating, preparing data): that is a **sign of life**, written as the end of a section
  (``section_ns``, as ``trainer_hooks`` marks one), so a long evaluation is not taken for a hang while
  a hang inside it still is; the interval around it, when long, is a stall the learned timeout does not
  learn (:class:`supervisor.diagnosis.hang_detector.AutoTimeout`).
"""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from rlsup_format.heartbeat_record import MAGIC, RECORD, RECORD_SIZE, SECTIONS, HeartbeatRecord, rank_file_name
from supervisor.settings_vocabulary import step_pattern

JOB_RANK = -1  # the job-level record's rank: not a rank of the job, the job as a whole

#: An optional prefix that launchers put before a rank's line (torchrun ``--tee``: ``[rank0]:``,
#: older ``[default0]:``): a bar keeps its shape behind it.
_RANK_PREFIX = r"^(?:\[\w+\]:)?\s*"

#: Any tqdm bar as tqdm's default format draws it: ``DESC: NN%|BAR| N/TOTAL [...`` (no description:
#: ``NN%|BAR| ...``; an unknown total: ``DESC: |BAR| N/? [...``). Used to tell one bar from another
#: (description and total) and to see whether a bar moved.
TQDM_BAR = re.compile(_RANK_PREFIX + r"(?:(?P<desc>[^|\x1b]*?):\s*)?(?:\d{1,3}%)?\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+|\?)\s*\[")

#: Bars that are never the training loop's, whatever pattern would read them (a ``progress_regex``
#: written for "any tqdm bar", or a preset's): their descriptions, each with where it comes from.
NOT_TRAINING: tuple[tuple[str, str], ...] = (
    (r"Writing model shards", "transformers 5.x PreTrainedModel.save_pretrained (modeling_utils.py), on every "
     "checkpoint save: '1/1' for a one-shard model, which the hf preset once read as step 1 after each save"),
    (r"Loading (?:checkpoint shards|weights)", "transformers from_pretrained (modeling_utils.py, "
     "core_model_loading.py): the model's load at start and on resume"),
    (r"Saving\b.*|Uploading\b.*", "datasets' save_to_disk ('Saving the dataset (1/1 shards)') and push_to_hub "
     "('Uploading the dataset shards'): saving, not training"),
    (r"(?:Map|Filter)(?: \(num_proc=\d+\))?|Filtering\b.*|Generating \w+ split|Tokeniz\w*\b.*|.*\bdatasets?\b.*",
     "datasets' Dataset.map/.filter (arrow_dataset.py: 'Map', 'Filter', 'Map (num_proc=N)'), load_dataset "
     "('Generating train split'), and any bar naming a dataset: TRL's preparation (sft_trainer.py: 'Tokenizing "
     "train dataset', 'Packing train dataset', ...), datasets' 'Saving the dataset', 'Loading dataset shards'"),
    (r"(?:Sanity Checking|Validation|Testing|Predicting)(?: DataLoader \d+)?",
     "Lightning's TQDMProgressBar evaluation bars (tqdm_progress.py): validation is not training"),
)
_NOT_TRAINING = re.compile("|".join(f"(?:{d})" for d, _ in NOT_TRAINING))


@dataclass(frozen=True)
class Preset:
    """A trainer's own progress line, as its source prints it."""

    regex: str
    source: str  # repository, file and function it comes from
    example: str  # a line as the trainer prints it (tests feed it)
    #: A line meaning the run is done, for trainers whose launcher exits non-zero even then: an exit
    #: after it ends the job as succeeded (not restarted). "": the exit code alone decides.
    done: str = ""
    #: How the step is read, where it is not simply the printed number (docs/progress.md shows it).
    note: str = ""


PRESETS: dict[str, Preset] = {
    "verl": Preset(
        r"step:(\d+) - ",  # anywhere in the line: ranks sharing a pipe interleave their writes
        "volcengine/verl 0.9.1, verl/utils/logger/aggregate_logger.py: concat_dict_to_str / LocalLogger.log "
        "(Tracking's console backend); under Ray the driver prefixes actor lines with '(TaskRunner pid=N)'",
        "(TaskRunner pid=4242) step:12 - actor/entropy:0.61 - actor/pg_loss:-0.003 - timing_s/step:41.2"),
    "areal": Preset(
        r"Train step (\d+)/\d+ done\.",
        "inclusionAI/AReaL @7ab3d64, areal/utils/stats_logger.py: StatsLogger.commit (logger 'StatsLogger'; "
        "the step printed is global_step + 1)",
        "20251124-08:41:03.123 StatsLogger INFO: Epoch 1/3 Step 12/200 Train step 12/600 done.",
        # the last step (N of N): AReaL's launchers then raise JobException(COMPLETED) and exit 1
        # (areal/infra/launcher/local.py, v1.0.4: a completed job cannot be told from a failed one)
        done=r"Train step (\d+)/\1 done\."),
    "megatron-bridge": Preset(
        r"\biteration\s+(\d+)/\s*\d+ \|",
        "NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/training/utils/train_utils.py: training_log "
        "(printed every logger.log_interval iterations by the last rank)",
        " [2026-11-24 08:41:03] iteration       12/     100 | consumed samples:          768 | "
        "elapsed time per iteration (ms): 412.3 | learning rate: 1.000000E-04 |"),
    # The whole segment is the bar: no description (transformers' own bars have one: 'Writing model
    # shards', datasets' 'Map'), and nothing after its closing ']' (the evaluation bar, drawn under it at
    # position 1, ends with the cursor-up escape '\x1b[A'; read early, before that escape arrives, it is
    # still told apart by its total: see StepTracker).
    "hf": Preset(
        _RANK_PREFIX + r"\d{1,3}%\|[^|]*\|\s*(?P<step>\d+)/(?P<total>\d+) \[[^\]]*\]\s*$",
        "huggingface/transformers 5.24, src/transformers/trainer_callback.py: ProgressCallback.training_bar "
        "(tqdm(total=state.max_steps), no description, updated to state.global_step on every step; its "
        "prediction_bar, tqdm(total=len(eval_dataloader)), is drawn under it, also without a description)",
        " 86%|████████▌ | 12/14 [00:04<00:00,  3.52it/s]",
        note="the bar's n, the global step; a bar of another total while it runs (the evaluation bar) is not it"),
    "nanogpt": Preset(
        r"\biter (\d+): loss \S+, time ",
        "karpathy/nanoGPT @3adf61e, train.py: print(f\"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, "
        "mfu {running_mfu*100:.2f}%\") every log_interval iterations on the master process (the evaluation "
        "line 'step N: train loss ...' is not read); print into a pipe is block-buffered: rlsup sets "
        "PYTHONUNBUFFERED=1 when progress is on",
        "iter 12: loss 3.3656, time 3058.91ms, mfu 0.00%",
        note="iter_num, the iteration just done (its checkpoint's iter_num is the next one to run)"),
    "lightning": Preset(
        _RANK_PREFIX + r"(?:Epoch (?P<epoch>\d+)|Training): *(?:\d{1,3}%)?\|[^|]*\| *(?P<step>\d+)/(?P<total>\d+|\?) \[",
        "Lightning-AI/pytorch-lightning 2.6, src/lightning/pytorch/callbacks/progress/tqdm_progress.py: "
        "TQDMProgressBar's train bar, 'Epoch E' (on_train_epoch_start), 'Training' for an epoch restored "
        "from a checkpoint; n = batch_idx + 1 within the epoch, total = the epoch's batches (clipped by "
        "max_steps). Not RichProgressBar, Lightning's default when rich is installed: it draws nothing "
        "into a pipe until the end",
        "Epoch 1:  50%|█████     | 4/8 [00:00<00:00, 568.87it/s, v_num=0, train_loss=1.860, val_loss=1.420]",
        note="batches since the start of training: the previous epochs' batches + n (Lightning's global "
             "step when a batch is one optimizer step); see below"),
}


def progress_pattern(preset: str, regex: str) -> re.Pattern[str] | None:
    """The pattern in force (``regex`` wins over ``preset``); ValueError naming what is wrong."""
    if not regex and not preset:
        return None
    if not regex:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
        regex = PRESETS[preset].regex
    return step_pattern(regex)


class _EpochSteps:
    """Lightning's bar counts batches within an epoch; the step is counted across epochs: the epochs
    before the first one seen in the attempt are as long as the epoch restored from the checkpoint (the
    'Training' bar's last n) or else as this epoch's total; each later epoch adds the batches the
    previous one showed. Exact for epochs of equal length, since Lightning clips the last epoch's total
    to max_steps."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.base = 0
        self.top = 0  # the highest n of the current epoch
        self.restored = 0  # the highest n of the 'Training' bar (an epoch restored, its number not printed)

    def step(self, m: re.Match[str]) -> int | None:
        n = _n(m)
        if m["epoch"] is None:
            self.restored = max(self.restored, n)
            return None  # which epoch is not printed: a sign of life, no step
        epoch = int(m["epoch"])
        if self.epoch is None:
            length = self.restored or (int(m["total"]) if m["total"].isdigit() else 0)
            self.epoch, self.base = epoch, epoch * length
        elif epoch > self.epoch:
            self.base += self.top * (epoch - self.epoch)
            self.epoch, self.top = epoch, 0
        elif epoch < self.epoch:
            return None  # backwards: not this attempt's training
        self.top = max(self.top, n)
        return self.base + n


class _BarSteps:
    """A bar over the steps (HF's training bar): the bar followed is the first one seen, and another
    one takes its place only once it is full (a later train() call, or a bar after training ended);
    while it runs, a bar of another total (the evaluation bar read before its escape arrived) is not it."""

    def __init__(self) -> None:
        self.total = ""
        self.n = -1

    def step(self, m: re.Match[str]) -> int | None:
        n, total = _n(m), m["total"]
        if total != self.total or n < self.n:
            running = self.total.isdigit() and self.n < int(self.total)
            if running and total != self.total:
                return None
            self.total = total
        self.n = n
        return n

    def full(self) -> bool:
        """The bar reached its total: the training loop is over (what follows is the final save and exit)."""
        return self.total.isdigit() and self.n >= int(self.total)


def _n(m: re.Match[str]) -> int:
    """The printed number: the ``step`` group, else the first group."""
    return int(m["step"] if "step" in m.re.groupindex else m.group(1))


def step_reader(pattern: re.Pattern[str]) -> Callable[[re.Match[str]], int | None]:
    """How a match gives the step: the named groups ``epoch`` (with ``step`` and ``total``: Lightning's
    bar), ``total`` (a bar over the steps: a :class:`_BarSteps`' method), else the step group as printed."""
    if "epoch" in pattern.groupindex:
        return _EpochSteps().step
    if "total" in pattern.groupindex:
        return _BarSteps().step
    return _n


class StepTracker:
    """What one output segment means: ``"beat"`` (a training step past the highest so far, now
    :attr:`step`), ``"alive"`` (something else moved) or None (nothing new)."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.read = step_reader(pattern)
        bar = getattr(self.read, "__self__", None)
        self.bar = bar if isinstance(bar, _BarSteps) else None  # a bar over the steps: its end is the loop's
        self.loop_total = ""  # the total of the training bar once it was full; "" while the loop runs
        self.step = -1  # the highest training step of the attempt
        self.seen: dict[tuple[str, str], int] = {}  # each bar's (or the lines') last n

    def loop_done(self) -> bool:
        """A bar over the steps (HF's) was full: the trainer is past its training loop, in its final save and
        exit, which no step interval paces (held to save_timeout, as trainer_hooks' exit section is). A later
        bar of another total (an evaluation) does not end that; the same bar restarting lower (another
        ``train()``) does."""
        return bool(self.loop_total)

    def _follow_loop_end(self) -> None:
        bar = self.bar
        if bar is None:
            return
        if bar.full():
            self.loop_total = bar.total
        elif bar.total == self.loop_total:
            self.loop_total = ""

    def feed(self, segment: str) -> str | None:
        match = None
        for match in self.pattern.finditer(segment):  # noqa: B007 - the last match wins: ranks sharing a pipe interleave writes
            pass
        bar = TQDM_BAR.match(segment)
        step = None
        if match is not None and not (bar is not None and _NOT_TRAINING.fullmatch((bar["desc"] or "").strip())):
            try:
                step = self.read(match)
            except (TypeError, ValueError, IndexError):
                step = None
            self._follow_loop_end()
        if bar is not None:
            moved = self._moved(((bar["desc"] or "").strip(), bar["total"]), int(bar["n"]))
        else:
            moved = step is not None and self._moved(("", "line"), step)
        if step is not None and step > self.step:
            self.step = step
            return "beat"
        return "alive" if moved else None

    def _moved(self, key: tuple[str, str], n: int) -> bool:
        last = self.seen.get(key, -1)
        if len(self.seen) > 256:
            self.seen.clear()
        self.seen[key] = n
        return n > last


class ProgressRecorder:
    """Feeds output segments to a :class:`StepTracker` and writes the job-level heartbeat record."""

    def __init__(self, pattern: re.Pattern[str], hb_dir: Path, pid: int, done: re.Pattern[str] | None = None,
                 output: Any = None) -> None:
        self.tracker = StepTracker(pattern)
        self.done = done
        self.output = output  # its ``finished`` is set to the line that says the run is done
        self.path = hb_dir / rank_file_name(JOB_RANK)
        self.pid = pid
        self.seq = 0
        self.prev: tuple[int, int] = (-1, 0)
        self.last: tuple[int, int] = (-1, 0)
        self.alive_ns = 0  # the last sign of life that was not a step
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, RECORD_SIZE)

    def feed(self, segment: str) -> None:
        what = self.tracker.feed(segment)
        if what == "beat":
            self.beat(self.tracker.step)
        elif what == "alive":
            self.alive()
        if self.done is not None and self.output is not None and self.done.search(segment):
            self.output.finished = segment.strip()[:500]

    def beat(self, step: int) -> None:
        self.prev, self.last = self.last, (step, time.monotonic_ns())
        self._write()

    def alive(self) -> None:
        """The end of a section: a sign of life that is not a step (``trainer_hooks`` does the same)."""
        self.alive_ns = time.monotonic_ns()
        self._write()

    def _write(self) -> None:
        self.seq += 2
        data = bytearray(RECORD_SIZE)
        section, since = SECTIONS["none"], self.alive_ns
        if self.tracker.loop_done():  # the final save and exit: held to save_timeout from the last sign of life
            section, since = SECTIONS["exit"], max(self.alive_ns, self.last[1])
        RECORD.pack_into(data, 0, self.seq, MAGIC, self.pid, self.last[0], self.last[1], section, since, 0, 0, 0)
        struct.pack_into("<4q", data, RECORD.size, self.prev[0], self.prev[1], 0, 0)
        os.pwrite(self.fd, bytes(data), 0)  # one write: the reader's seqlock check never sees half of it

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def presets_markdown() -> str:
    """docs/progress.md's table of presets, generated from :data:`PRESETS` (a test keeps them equal)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| preset | regex | source | a line it reads | step read |", "|---|---|---|---|---|"]
    for name, p in PRESETS.items():
        tracker = StepTracker(re.compile(p.regex))
        tracker.feed(p.example)
        step = f"{tracker.step}" + (f": {p.note}" if p.note else "")
        rows.append(f"| `{name}` | `{cell(p.regex)}` | {cell(p.source)} | `{cell(p.example)}` | {cell(step)} |")
    return "\n".join(rows) + "\n"


def not_training_markdown() -> str:
    """docs/progress.md's list of the bars never read as steps, from :data:`NOT_TRAINING`."""
    return "".join(f"- `{desc}`: {why}\n" for desc, why in NOT_TRAINING)


def job_level_only(records: Iterable[HeartbeatRecord]) -> bool:
    """Whether the job-level record is the only source of heartbeats (no rank has beaten itself)."""
    return not any(r.rank != JOB_RANK and r.beat_ns > 0 for r in records)


def speaking_records(records: Mapping[int, HeartbeatRecord]) -> dict[int, HeartbeatRecord]:
    """The records that speak for the job: the ranks' own once any rank beats, else all (the output's)."""
    if job_level_only(records.values()):
        return dict(records)
    return {r: rec for r, rec in records.items() if r != JOB_RANK}


def registered_ranks(records: Mapping[int, HeartbeatRecord]) -> dict[int, HeartbeatRecord]:
    """The ranks that registered (a record, beaten or not: trainer_hooks installed its handlers before
    creating it), else the output's record alone: who a preemption signal goes to."""
    return {r: rec for r, rec in records.items() if r != JOB_RANK} or dict(records)


def rank_label(rank: int) -> str:
    """A metric's ``local_rank`` value: the job-level record is ``job``, not a rank number."""
    return "job" if rank == JOB_RANK else str(rank)


def attach(preset: str, regex: str, job: Any, hb_dir: Path) -> ProgressRecorder | None:
    """Start matching ``job``'s output (a :class:`supervisor.processes.job.JobProcess`) when
    ``progress``/``progress_regex`` is set; else do nothing."""
    pattern = progress_pattern(preset, regex)
    if pattern is None:
        return None
    done = re.compile(PRESETS[preset].done) if not regex and PRESETS[preset].done else None
    recorder = ProgressRecorder(pattern, hb_dir, job.pid, done, job.output)
    job.output.on_segment = recorder.feed
    return recorder
