"""The last step of a batch: its output and error files written and its final status given, in
one transaction.

Once its last item is final a batch is `finalizing` (or still `cancelling`); the gateway holding
its lease then writes every item's line, in submission order, into the output file (answers)
or the error file (failures), and gives the batch its final status with both files' ids. The
transaction starts by re-checking the batch under a write lock: of two gateways that both
believe they hold it (a lease lapsed), one writes the files and the other writes nothing. A
gateway that dies midway leaves nothing behind; the next one to claim the batch starts over.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Literal

from sqlalchemy import select

from gateway.batches.records import BatchView, FinalItem, batch_view
from gateway.batches.settling import final_status, update_open
from gateway.db.models import BatchItem, BatchJob, utcnow
from gateway.db.session import SessionStore
from gateway.stores.file_store import FileWriter, NewFile
from gateway.stores.pages import rowcount

ResultFile = Literal["output", "error"]
# Which file an item's line goes to, and the line (with its newline).
RenderLine = Callable[[FinalItem], tuple[ResultFile, bytes]]
RESULT_PURPOSE = "batch_output"
# Items read per query while writing the files. A page's rows are decoded and rendered in one
# stretch of the event loop: 1,000 held it 27-34 ms of CPU on a loaded 2-core host (issue 67),
# 250 a quarter of that, for a quarter more queries on the (batch_id, item_index) index.
_PAGE = 250


# What a line needs of an item, read as plain columns: not the items as ORM objects with their
# request bodies, whose thousands of dicts a page made the garbage collector walk again and again
# while a cancelled 90,000-item batch's error file was written (bench/results/batch_scale).
_LINE_COLUMNS = (
    BatchItem.item_index,
    BatchItem.custom_id,
    BatchItem.status,
    BatchItem.request_id,
    BatchItem.completion,
    BatchItem.error,
    BatchItem.status_code,
)


class BatchFinalizer(SessionStore):
    async def finalize(
        self,
        batch_id: str,
        render: RenderLine,
        files_expire_at: datetime,
        new_file_id: Callable[[], str],
    ) -> BatchView | None:
        """Writes the files of a batch whose items are all final and settles it; None, writing
        nothing, when it is not waiting for that (settled already, or still running)."""
        async with self._sessions.begin() as session:
            # A write first: SQLite then holds its write lock, PostgreSQL the row's.
            taken = await session.execute(
                update_open(batch_id, BatchJob.finalizing_at.is_not(None)).values(
                    finalizing_at=BatchJob.finalizing_at
                )
            )
            if rowcount(taken) != 1:
                return None
            batch = await session.get(BatchJob, batch_id, populate_existing=True)
            status = final_status(batch) if batch is not None else None
            if batch is None or status is None:
                return None
            writers: dict[ResultFile, FileWriter] = {}
            after = -1
            while True:
                rows = (
                    await session.execute(
                        select(*_LINE_COLUMNS)
                        .where(BatchItem.batch_id == batch_id, BatchItem.item_index > after)
                        .order_by(BatchItem.item_index)
                        .limit(_PAGE)
                    )
                ).all()
                if not rows:
                    break
                for row in rows:
                    kind, line = render(FinalItem(*row))
                    if kind not in writers:
                        new = NewFile(
                            id=new_file_id(),
                            owner=batch.api_key_id,
                            purpose=RESULT_PURPOSE,
                            filename=f"{batch_id}_{kind}.jsonl",
                            expires_at=files_expire_at,
                            batch_id=batch_id,
                        )
                        writers[kind] = await FileWriter.open(session, new)
                    await writers[kind].write(line)
                after = rows[-1].item_index
            files = {kind: await writer.close() for kind, writer in writers.items()}
            batch.status, batch.finished_at = status, utcnow()
            batch.output_file_id = files["output"].id if "output" in files else None
            batch.error_file_id = files["error"].id if "error" in files else None
            batch.owner = batch.lease_until = None
            await session.flush()
            return batch_view(batch)
