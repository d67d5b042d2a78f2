"""The OpenAI fine-tuning API (issue 54): jobs made from an uploaded chat JSONL file, trained as
LoRA adapters on a site that accepts them, and served when done under their `ft:` model name.

file_check.py checks a file line by line in processes of their own (check_worker.py), which
checker.py runs and feeds fairly between keys; service.py is the API's
operations, each scoped to the caller's key; runner.py hands queued jobs to sites, follows their
progress and registers a succeeded job's adapter; reconcile.py cancels at a site the jobs the
database does not hold as live there. SQL lives in gateway/stores/fine_tuning_store.py.
"""
