"""The demo's prompts when the datasets are not on this machine: a fresh clone without the shared
folder beside it still runs `make demo` (issue 67: it ended in a DatasetError traceback).

The prompts are written for this repository, of the three kinds the demo draws from the datasets
(short instructions, a question over a pasted context, a maths word problem), so routing and
batching see a similar mix. Without the datasets there is no length predictor either (it is
trained on them): the gateway then plans each answer at its `max_tokens`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from predictor.datasets import DEFAULT_DATA_DIR, PromptRecord

# The files of the corpora the demo samples (predictor.datasets reads them).
DEMO_FILES = ("alpaca.jsonl", "dolly_3k.json", "gsm8k_train.jsonl")

_INSTRUCTIONS = (
    "Give three tips for staying focused while working from home.",
    "Write a haiku about a train arriving in the rain.",
    "Explain the difference between a virus and a bacterium in two sentences.",
    "Suggest a name for a bakery that sells only sourdough bread.",
    "List four ways to reduce the energy a household uses in winter.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Describe how a refrigerator keeps food cold, for a ten-year-old.",
    "Write a short, polite email declining an invitation to a conference.",
    "Classify each as a fruit or a vegetable: tomato, carrot, apple, spinach, cucumber.",
)
_WITH_CONTEXT = (
    "When was the bridge opened, and how long is it?\n\nThe Øresund Bridge is a combined railway "
    "and motorway bridge across the Øresund strait between Denmark and Sweden. It is nearly 8 "
    "kilometres long and runs from the Swedish coast to an artificial island, where it joins a "
    "tunnel to the Danish island of Amager. The bridge was opened to traffic on 1 July 2000.",
    "Summarise this paragraph in one sentence.\n\nHoneybees communicate the location of food "
    "through the waggle dance. A forager returning to the hive walks in a figure-eight pattern, "
    "and the angle of the straight run relative to vertical tells the others the direction of "
    "the food relative to the sun, while the length of the run signals the distance.",
    "Which programming languages are mentioned, and what was each designed for?\n\nFORTRAN was "
    "created in the 1950s for scientific and engineering calculations. COBOL followed a few "
    "years later for business data processing, and Lisp was designed for symbolic computation "
    "in artificial intelligence research.",
    "From the text, what are the two main causes of tides?\n\nTides are the regular rise and "
    "fall of sea level. They are caused mainly by the gravitational pull of the Moon and, to a "
    "lesser extent, the Sun, together with the rotation of the Earth.",
    "Extract the dates and what happened on each.\n\nThe library closed for renovation on 3 "
    "March. The new reading room opened on 12 June, and the archive moved back into the "
    "basement on 30 September.",
    "Is the following review positive or negative? Explain briefly.\n\nThe soup arrived cold "
    "and the waiter ignored us for twenty minutes, but the dessert was honestly the best I have "
    "had this year.",
    "What does the passage say about the speed of light in water?\n\nLight travels at about "
    "300,000 kilometres per second in a vacuum. In water it slows to roughly 225,000 kilometres "
    "per second, which is why a straw in a glass appears bent.",
)
_MATHS = (
    "A baker makes 48 rolls. She sells 3/4 of them in the morning and half of the rest in the "
    "afternoon. How many rolls are left at the end of the day?",
    "Tom has 5 boxes with 12 pencils each. He gives 17 pencils to his sister. How many pencils "
    "does he have now?",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed "
    "for the whole trip?",
    "A shirt costs $25. It is on sale for 20% off, and then a further $3 coupon is applied. How "
    "much does the shirt cost?",
    "Maria reads 15 pages a day. Her book has 340 pages and she has already read 85. How many "
    "more days does she need to finish it?",
    "A garden is 8 m long and 5 m wide. A path 1 m wide runs all around the outside of it. What "
    "is the area of the path?",
    "Three friends share a pizza bill of $42 and a 15% tip equally. How much does each pay?",
)
BUILTIN_PROMPTS: tuple[PromptRecord, ...] = tuple(
    PromptRecord(kind, index, prompt, "")
    for kind, prompts in (
        ("builtin:instruction", _INSTRUCTIONS),
        ("builtin:context", _WITH_CONTEXT),
        ("builtin:maths", _MATHS),
    )
    for index, prompt in enumerate(prompts)
)


def dataset_candidates(explicit: Path | None) -> list[Path]:
    """Where the demo looks for the datasets, in order: --data-dir, FEDLLM_DATA_DIR,
    FEDLLM_SHARED_DIR/datasets, ../shared/datasets beside the checkout."""
    found = [explicit] if explicit is not None else []
    if os.environ.get("FEDLLM_DATA_DIR"):
        found.append(Path(os.environ["FEDLLM_DATA_DIR"]))
    if os.environ.get("FEDLLM_SHARED_DIR"):
        found.append(Path(os.environ["FEDLLM_SHARED_DIR"]) / "datasets")
    return [*found, DEFAULT_DATA_DIR]


def find_datasets(explicit: Path | None) -> Path | None:
    """The first candidate holding the demo's corpora, else None (the built-in prompts)."""
    for candidate in dataset_candidates(explicit):
        if all((candidate / name).is_file() for name in DEMO_FILES):
            return candidate
    return None


def no_datasets_notice(explicit: Path | None) -> str:
    """One paragraph: what the demo does without the datasets, and how to point at them."""
    looked = ", ".join(str(path) for path in dataset_candidates(explicit))
    return (
        f"demo: no datasets found (looked in {looked}), so it sends prompts built into the "
        f"repository ({len(BUILTIN_PROMPTS)} in devtools/demo_prompts.py) and runs without the "
        "length predictor, "
        "which is trained on the datasets (the gateway plans each answer at its max_tokens). "
        "The datasets (Alpaca, Dolly, LIMA and GSM8K records) and tokenizers are not in the "
        "repository: they live in a `shared` folder beside the checkout (../shared/datasets, "
        "../shared/tokenizers; the README's 'Datasets and tokenizers' says what each holds); "
        "set FEDLLM_SHARED_DIR to that folder, or FEDLLM_DATA_DIR (or `make demo DATA_DIR=...`) "
        "to the datasets folder itself."
    )


def builtin_workload(requests: int, seed: int) -> list[PromptRecord]:
    """`requests` built-in prompts in a seeded order; past their number, they repeat."""
    order = list(BUILTIN_PROMPTS)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(requests)]
