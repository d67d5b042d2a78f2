"""The seam of an answer continued on another site: which tokens are kept, what text is carried
over, and stop strings found across the seam (gateway/dispatch/continuation.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gateway.dispatch.continuation import Splice, resume_point

# A toy byte-level vocabulary: each token is some bytes; 9 and 10 are the halves of "é".
VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"!", 9: b"\xc3", 10: b"\xa9"}


def decode(ids: Sequence[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    ("ids", "sent", "kept", "carry"),
    [
        ((1, 2, 3), "Hello wor", (1, 2, 3), ""),  # everything sent
        ((1, 2, 3), "Hello", (1, 2, 3), " wor"),  # " wor" held back (a possible stop prefix)
        ((1, 2, 9), "Hello", (1, 2), ""),  # half a character: that token is generated again
        ((1, 9, 10), "Hel", (1, 9, 10), "é"),
        ((), "", (), ""),
        ((1, 2), "something else", (1, 2), ""),  # not decodable piecewise: nothing twice
    ],
)
def test_resume_point(ids, sent, kept, carry) -> None:
    point = resume_point(ids, sent, decode)
    assert (point.kept_token_ids, point.carry) == (kept, carry)


def test_a_stop_string_across_the_seam_ends_the_answer() -> None:
    splice = Splice(("STOP",), pending="ab ST")
    assert splice.feed("O") == "ab "  # "STO" could still become "STOP": held back
    assert splice.pending == "STO"
    assert splice.feed("P and more") == ""
    assert splice.stopped
    assert splice.feed("ignored") == ""
    assert splice.flush() == ""


def test_the_carry_goes_out_before_the_new_text() -> None:
    splice = Splice(())
    splice.pending = "held "
    assert splice.feed("next") == "held next"
    assert splice.flush() == ""


def test_a_false_alarm_is_released_at_the_end() -> None:
    splice = Splice(("STOP",), pending="S")
    assert splice.feed("T") == ""
    assert splice.flush() == "ST"


@given(
    carry=st.text(alphabet="abS", max_size=6),
    pieces=st.lists(st.text(alphabet="abST", max_size=4), max_size=6),
    stop=st.sampled_from(["ST", "abS", "b"]),
)
def test_splice_output_is_the_text_cut_at_the_first_stop(carry, pieces, stop) -> None:
    """Whatever the chunking, the caller gets carry + text cut before the first stop string,
    and nothing after it. The carry never holds a whole stop string (its site would have
    stopped); the pieces may (the splice must cut them regardless)."""
    assume(stop not in carry)
    splice = Splice((stop,), pending=carry)
    out = "".join(splice.feed(piece) for piece in pieces)
    if not splice.stopped:
        out += splice.flush()
    whole = carry + "".join(pieces)
    cut = whole.find(stop)
    assert out == (whole if cut < 0 else whole[:cut])
