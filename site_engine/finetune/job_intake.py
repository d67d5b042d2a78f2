"""A site's fine-tuning job taken in: its spec and files saved on the site's disk, then read into
examples in its tenant's turns (site_engine/finetune/reading_turns.py), on a thread of the job's
own (site_engine/finetune/jobs.py keeps the table of jobs and trains them).

A new job's files are written first, without waiting for a turn, and the message that brought
them is let go: a job waiting for its turn holds its files on disk, not in memory. Its reading
stops as soon as the job is cancelled or the site stops (`stopped`), and a job that ended while
its files were saved has them cleared at once (checkpoint.clear_ended).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from fedllm_contract.fine_tuning import FineTuneSpec
from fedllm_contract.training_data import Stopped
from site_engine.finetune import FineTuneRefused
from site_engine.finetune import checkpoint as disk
from site_engine.finetune.intake import read_examples
from site_engine.finetune.job_state import FineTuneSettings, Job
from site_engine.finetune.memory import TrainingShape
from site_engine.finetune.reading_turns import ReadingTurns

log = logging.getLogger(__name__)


class JobIntake:
    def __init__(
        self,
        settings: FineTuneSettings,
        tokenizer: PreTrainedTokenizerBase,
        shape: TrainingShape,
        lock: threading.Lock,
        fail: Callable[[Job, str], None],
    ) -> None:
        """`lock`: the job table's (a job's state changes under it); `fail`: ends a job whose
        files cannot train, with why."""
        self._settings, self._tokenizer, self._shape = settings, tokenizer, shape
        self._lock, self._fail = lock, fail
        self._reading = ReadingTurns()
        self._room = disk.DirectoryRoom(settings.directory, settings.max_dir_bytes)
        self._closing = threading.Event()

    def claim(self, job_id: str, files_bytes: int) -> None:
        """Room in the directory for a new job's files (the caller holds the table's lock);
        FineTuneRefused when the directory's bound does not hold them."""
        self._room.claim(job_id, files_bytes)

    def take_in(self, job: Job, spec: FineTuneSpec | None) -> None:
        """Saves `spec` (None: the job is on disk already, found there at the site's start)
        and reads the job's files, on a thread of its own."""
        unsaved = [spec] if spec is not None else []
        name = f"finetune-intake-{job.job_id}"
        threading.Thread(target=self._take_in, args=(job, unsaved), name=name, daemon=True).start()

    def stopped(self, job: Job) -> bool:
        return job.stop.is_set() or self._closing.is_set()

    def wake(self) -> None:
        """A job was cancelled: its reading, if it waits for a turn, ends."""
        self._reading.wake()

    def close(self) -> None:
        """The site stops: readings stop (a job is read again at the next start)."""
        self._closing.set()
        self._reading.close()

    def _take_in(self, job: Job, unsaved: list[FineTuneSpec]) -> None:
        """Saves the job's spec (popped from `unsaved`, so that its files wait for their turn
        on disk, not in memory) and reads its files in its tenant's turns; the job fails when
        they cannot train, and is left as it is when its reading was stopped."""
        job_dir = self._settings.directory / job.job_id
        try:
            if unsaved and not self._save(job, job_dir, unsaved.pop()):
                return
            with self._reading.turn(job.tenant, lambda: self.stopped(job)) as turn:
                examples = read_examples(
                    disk.load_spec(job_dir),
                    self._tokenizer,
                    self._shape,
                    self._settings.max_tokens,
                    self._settings.reserve_bytes,
                    lambda: self._reading.pause(turn),
                )
            with self._lock:
                if job.progress.state.is_final:
                    return
                job.examples = examples
                job.progress = replace(job.progress, total_steps=examples.total_steps)
            log.info("fine-tuning job %s queued: %d steps", job.job_id, examples.total_steps)
        except Stopped:
            log.info("fine-tuning job %s: the reading of its files stopped", job.job_id)
        except FineTuneRefused as exc:
            self._fail(job, str(exc))
        except Exception as exc:  # the job fails; the site serves on
            log.exception("fine-tuning job %s: its files could not be read", job.job_id)
            self._fail(job, f"{type(exc).__name__}: {exc}")
        finally:
            self._room.written(job.job_id)
            job.settled.set()

    def _save(self, job: Job, job_dir: Path, spec: FineTuneSpec) -> bool:
        """Writes the job's spec and files; False when it ended meanwhile (or the site stops)."""
        if self.stopped(job):
            return False
        disk.save_spec(job_dir, spec)
        del spec
        self._room.written(job.job_id)
        with self._lock:
            job.on_disk = True
            if not job.progress.state.is_final:
                return not self._closing.is_set()
            disk.save_result(job_dir, job.progress)  # cancelled while it was saved
        disk.clear_ended(job_dir)
        return False
