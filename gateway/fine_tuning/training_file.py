"""A fine-tuning job's files checked when the job is made: their size against
GATEWAY_FINE_TUNING_MAX_FILE_BYTES (what a site takes in the one message that starts a job),
then every line with the check the site runs too (fedllm_contract/training_data.py), off the
event loop: 60 MiB of JSON takes seconds to parse, and on the loop it held every other request,
health checks included, for as long (issue 58). A file with any bad line is refused whole,
naming its first bad lines and why, so that a tenant fixes them all at once."""

from __future__ import annotations

from fedllm_contract import training_data
from fedllm_contract.training_data import MAX_LISTED, Summary, TrainingFileError
from gateway.errors import invalid_request
from gateway.files.service import file_too_large
from gateway.tokenize_pool import TokenizePool

__all__ = ["MAX_LISTED", "check_training_file", "file_too_large", "read_training_file"]


def check_training_file(content: bytes, param: str) -> Summary:
    """The file's examples; 400 (`param` at fault, code invalid_training_file) listing the first
    MAX_LISTED bad lines by number for any bad line, or for an empty file."""
    try:
        return training_data.check(content)
    except TrainingFileError as exc:
        raise invalid_request(str(exc), param=param, code="invalid_training_file") from exc


async def read_training_file(pool: TokenizePool, content: bytes, param: str) -> Summary:
    """check_training_file on one of the pool's threads (a small file on the loop)."""
    return await pool.run(lambda data: check_training_file(data, param), content, len(content))
