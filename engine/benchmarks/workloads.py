"""Prompt sets for benchmarks: built-in chat, input-grounded, JSON and repeated-traffic
workloads, or JSONL."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_PROMPTS = [
    "What are three tips for staying productive when working from home?",
    "Write a short poem about the sea at night.",
    "Explain how a rainbow forms, in simple words.",
    "What should I pack for a weekend hiking trip?",
    "Give me an idea for a birthday party for a ten year old.",
    "Why do cats purr?",
    "Describe a perfect Sunday morning.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small coffee shop and explain why.",
    "How do I make a simple tomato pasta sauce?",
    "What are the benefits of learning a second language?",
    "Tell me a short story about a robot who learns to paint.",
    "How can I improve my sleep?",
    "What is photosynthesis?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are some good habits for saving money?",
]

_PASSAGES = [
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    "Council members approved a budget of 2.4 million dollars for the project, which "
    "will add protected lanes along 3 miles of road. Construction starts in April and "
    "should finish by October. Local shop owners worried about parking, so the plan "
    "keeps 80 percent of the existing parking spaces.",
    "Maria Lopez joined Northwind Traders in 2019 as a junior analyst. In 2021 she was "
    "promoted to senior analyst, and in 2023 she became head of the data team, which "
    "now has 12 people. She holds a degree in statistics from the University of Leeds "
    "and speaks English, Spanish and Portuguese.",
    "To reset the router, unplug the power cable and wait 30 seconds. Plug the cable "
    "back in and wait until the status light turns solid green, which takes about two "
    "minutes. If the light blinks orange, press the reset button on the back for 10 "
    "seconds. Then connect to the network named HomeNet with the password on the label.",
    "The museum is open from 9 am to 5 pm on weekdays and from 10 am to 6 pm on "
    "weekends. Tickets cost 15 dollars for adults, 8 dollars for students and are free "
    "for children under 12. The museum is closed on Mondays and on public holidays. "
    "Guided tours start every hour from the main hall.",
]

_TASKS = [
    "Summarize the following text in two sentences.",
    "Rewrite the following text in plain words, keeping every number.",
    "List every number in the following text with what it refers to.",
    "Extract the key facts from the following text as a bulleted list.",
]

GROUNDED_PROMPTS = [f"{task}\n\n{passage}" for passage in _PASSAGES for task in _TASKS]


def _text(max_length: int = 48) -> dict:
    return {"type": "string", "maxLength": max_length}


def _object(**properties) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# Extraction, the way a backend service asks for it: a schema per passage. Strings and
# lists are bounded, so every answer can complete within a benchmark's output length.
_SCHEMAS = [
    _object(
        topic=_text(),
        budget_million_dollars={"type": "number"},
        miles={"type": "integer"},
        start_month=_text(12),
        end_month=_text(12),
    ),
    _object(
        name=_text(),
        company=_text(),
        joined={"type": "integer"},
        role=_text(),
        team_size={"type": "integer"},
        languages={"type": "array", "items": _text(16), "maxItems": 4},
    ),
    _object(
        wait_seconds={"type": "integer"},
        light_color=_text(16),
        network=_text(24),
        steps={"type": "array", "items": _text(), "maxItems": 4},
    ),
    _object(
        weekday_hours=_text(24),
        weekend_hours=_text(24),
        adult_price={"type": "number"},
        student_price={"type": "number"},
        closed_on={"type": "array", "items": _text(24), "maxItems": 3},
    ),
]

# (prompt, JSON schema): each passage with the fields to extract from it.
JSON_REQUESTS = [
    (
        "Extract these fields from the text as JSON: "
        f"{', '.join(schema['properties'])}.\n\n{passage}",
        schema,
    )
    for passage, schema in zip(_PASSAGES, _SCHEMAS, strict=True)
]
JSON_PROMPTS = [prompt for prompt, _ in JSON_REQUESTS]

_PEOPLE = [
    ("Anna Berg", 34, "Oslo", "nurse"),
    ("Tomas Novak", 51, "Brno", "carpenter"),
    ("Li Wei", 27, "Chengdu", "software tester"),
    ("Fatima Diallo", 42, "Dakar", "teacher"),
    ("Jonas Weber", 38, "Leipzig", "bus driver"),
    ("Priya Nair", 29, "Kochi", "architect"),
    ("Marco Rossi", 63, "Turin", "baker"),
    ("Sara Cohen", 45, "Haifa", "pharmacist"),
    ("Diego Alvarez", 31, "Seville", "electrician"),
    ("Emma Clarke", 56, "Leeds", "librarian"),
    ("Kenji Sato", 40, "Sendai", "chef"),
    ("Olga Petrova", 36, "Kazan", "accountant"),
]
_EXTRACTION = (
    "Read the note and fill in the form below, one field per line, exactly in this "
    "format:\nName: <full name>\nAge: <age in years>\nCity: <city>\nJob: <job>\n"
    "Summary: <one sentence about the person>\n\nNote: {name} is {age} years old, "
    "lives in {city} and works as a {job}."
)
# Repeated traffic, as a backend service sends it: one extraction template over many
# inputs, then a second pass over earlier requests (retries, the same question asked
# again). What suffix decoding's cache of recent answers is for.
REPEATED_PROMPTS = [
    _EXTRACTION.format(name=name, age=age, city=city, job=job) for name, age, city, job in _PEOPLE
]
REPEATED_PROMPTS += REPEATED_PROMPTS[:4]

BUILTIN = {
    "chat": CHAT_PROMPTS,
    "grounded": GROUNDED_PROMPTS,
    "json": JSON_PROMPTS,
    "repeated": REPEATED_PROMPTS,
}


def json_schemas(num_prompts: int) -> list[dict]:
    """The schema of each of the first ``num_prompts`` prompts of the json workload."""
    return [JSON_REQUESTS[i % len(JSON_REQUESTS)][1] for i in range(num_prompts)]


def load_prompts(workload: str, num_prompts: int) -> list[str]:
    """`workload` is a built-in name or a JSONL file with a "prompt" field per line."""
    if workload in BUILTIN:
        base = BUILTIN[workload]
    else:
        path = Path(workload)
        if not path.is_file():
            raise ValueError(
                f"workload must be one of {', '.join(BUILTIN)} or a JSONL file, got {workload!r}"
            )
        base = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
        if not base:
            raise ValueError(f"{workload}: no prompts found")
    return [base[i % len(base)] for i in range(num_prompts)]


def valid_share(answers: list[str], schemas: list[dict]) -> float:
    """The share of answers that parse as JSON and validate against their schema."""
    try:
        import jsonschema
    except ImportError:
        raise RuntimeError(
            "the json workload checks its answers with jsonschema: pip install jsonschema "
            "(or the test extra)"
        ) from None
    valid = 0
    for answer, schema in zip(answers, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(answer), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid / max(len(answers), 1)
