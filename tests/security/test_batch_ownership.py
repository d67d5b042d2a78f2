"""Finding 1: batches belonged to no one. With key B, `GET /v1/batches` listed key A's batch,
`GET /v1/batches/{id}` and `/results` returned A's completions and `POST .../cancel` stopped it;
and A's batch items were recorded without a key, so A's usage missed their tokens.

Now a batch belongs to the key that created it: every batch query is scoped to the caller (404
for anyone else, as for a batch that does not exist), and each item's request row carries the
key, so usage per key counts batch tokens.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Federation, wait_until_written
from tests.security.batch_keys import (
    KEYS_REQUIRED,
    admin,
    client_of,
    long_items,
    make_key,
    wait_final,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1"], env={**KEYS_REQUIRED, "GATEWAY_BATCH_SITE_CONCURRENCY": "1"}
    )


def test_another_key_can_neither_see_read_nor_cancel_a_batch(federation: Federation) -> None:
    alice, bob = make_key(federation, "alice"), make_key(federation, "bob")
    with client_of(federation, alice) as mine, client_of(federation, bob) as theirs:
        done = mine.post("/v1/batches", json={"model": "tiny", "requests": long_items(3, 4)})
        assert done.status_code == 200, done.text
        finished = wait_final(mine, done.json()["id"])
        assert finished["status"] == "completed"
        running = mine.post("/v1/batches", json={"model": "tiny", "requests": long_items(6, 200)})
        assert running.status_code == 200, running.text
        batch_ids = [finished["id"], running.json()["id"]]

        listed = theirs.get("/v1/batches", params={"limit": 100}).json()["data"]
        assert not {b["id"] for b in listed} & set(batch_ids)
        for batch_id in batch_ids:
            for method, path in [
                ("GET", f"/v1/batches/{batch_id}"),
                ("GET", f"/v1/batches/{batch_id}/results"),
                ("POST", f"/v1/batches/{batch_id}/cancel"),
            ]:
                answer = theirs.request(method, path)
                assert answer.status_code == 404, (method, path, answer.text)
                assert answer.json()["error"]["code"] == "batch_not_found"
        assert theirs.get("/v1/batches", params={"after": batch_ids[0]}).status_code == 400

        # The owner still sees both, and bob's cancel stopped nothing.
        assert {b["id"] for b in mine.get("/v1/batches").json()["data"]} >= set(batch_ids)
        assert mine.get(f"/v1/batches/{batch_ids[0]}/results").status_code == 200
        assert wait_final(mine, batch_ids[1])["status"] == "completed"

    # Every item's request row names alice's key: her usage counts the batch tokens.
    wait_until_written(federation.base_url)  # outcome writes of the last items
    with admin(federation) as operator:
        usage = operator.get(
            f"/admin/api/keys/{alice['id']}/usage", params={"window_s": 3600}
        ).json()
        assert usage["requests"] == 9
        assert usage["completion_tokens"] == 3 * 4 + 6 * 200
        assert (
            operator.get(f"/admin/api/keys/{bob['id']}/usage", params={"window_s": 3600}).json()[
                "requests"
            ]
            == 0
        )
