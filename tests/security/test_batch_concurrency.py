"""Issue 32, finding 3: batch items ignored their key's concurrency cap. A key with
`max_concurrent_requests=1` had 9 batch items generating at once (the batch runner's own bound
is per site, GATEWAY_BATCH_SITE_CONCURRENCY, 16 by default).

Through a real gateway and site: each item of the key's batch now takes one of the key's slots
while it runs (waiting for one rather than failing, as its requests and tokens were charged at
submission), so the request rows of its items never overlap in time.
"""

from __future__ import annotations

import itertools

import pytest

from tests.e2e.conftest import Federation
from tests.security.batch_keys import KEYS_REQUIRED, admin, client_of, long_items, wait_final

pytestmark = pytest.mark.slow
ITEMS = 6


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(live=["aws-use1"], env=KEYS_REQUIRED)


def test_batch_items_run_within_the_keys_concurrency_cap(federation: Federation) -> None:
    with admin(federation) as operator:
        made = operator.post(
            "/admin/api/keys", json={"name": "capped", "max_concurrent_requests": 1}
        )
    assert made.status_code == 201, made.text
    key = made.json()
    with client_of(federation, key) as client:
        batch = client.post(
            "/v1/batches", json={"model": "tiny", "requests": long_items(ITEMS, 60)}
        ).json()
        done = wait_final(client, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == ITEMS
    rows = federation.rows(f"r.api = 'batch' AND r.api_key_id = {key['id']}")
    spans = sorted((str(row["dispatched_at"]), str(row["finished_at"])) for row in rows)
    assert len(spans) == ITEMS
    assert all(end != "None" for _, end in spans)
    overlapping = [
        (earlier, later) for earlier, later in itertools.pairwise(spans) if later[0] < earlier[1]
    ]
    assert overlapping == [], f"{len(overlapping) + 1} items of a capped key ran at once"
