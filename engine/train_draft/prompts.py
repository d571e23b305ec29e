"""Prompts the target answers to make a draft's training data (self-distillation).

The built-in set is chat requests composed from templates and slot lists written for this
project, plus requests about passages of text that ship with Python (standard-library
module docstrings): thousands of distinct prompts, no download. The benchmarks' chat
and grounded prompts (engine/benchmarks/workloads.py) are never in it, so acceptance
measured on them is held out. ``--prompts FILE`` replaces the set: one prompt per line,
or JSONL with a "prompt" field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_ACTIVITIES = [
    "studying for an exam",
    "running a first marathon",
    "learning to cook",
    "moving to a new city",
    "starting a vegetable garden",
    "keeping a tidy desk",
    "writing a novel",
    "training a puppy",
    "learning the guitar",
    "staying healthy in winter",
    "planning a wedding",
    "reading more books",
    "working night shifts",
    "travelling on a budget",
    "starting a small business",
    "public speaking",
    "camping with children",
    "learning to swim",
    "taking better photos",
    "managing a remote team",
    "getting up early",
    "drinking more water",
    "painting a room",
    "preparing for a job interview",
    "caring for houseplants",
    "cycling to work",
    "writing a cover letter",
    "learning to code",
    "decluttering a home",
    "baking bread",
    "making new friends as an adult",
    "staying calm in traffic",
    "teaching a child to read",
    "meditating every day",
    "organizing a family reunion",
    "reducing food waste",
]
_THINGS = [
    "the moon",
    "an old lighthouse",
    "autumn leaves",
    "a city at dawn",
    "a sleeping cat",
    "the first snow",
    "a mountain lake",
    "a busy train station",
    "a grandmother's kitchen",
    "the desert wind",
    "a summer storm",
    "a forgotten letter",
    "the northern lights",
    "a field of sunflowers",
    "an empty playground",
    "a river in spring",
    "the smell of rain",
    "a quiet library",
    "a fishing boat",
    "a candle in the dark",
    "a hummingbird",
    "the ocean floor",
    "a market in the morning",
    "a snowy forest",
    "a broken clock",
    "the last day of school",
]
_PHENOMENA = [
    "thunder",
    "the tides",
    "a compass",
    "a refrigerator",
    "vaccines",
    "the seasons",
    "an eclipse",
    "a bicycle gear",
    "the internet",
    "a volcano",
    "evaporation",
    "a microwave oven",
    "gravity",
    "a credit card",
    "an airplane wing",
    "the heart",
    "a solar panel",
    "an earthquake",
    "yeast",
    "a battery",
    "snowflakes",
    "the human eye",
    "a lock and key",
    "a thermometer",
    "echoes",
    "wind",
    "a telescope",
    "recycling",
    "soap",
    "a hot air balloon",
    "coral reefs",
    "fog",
]
_CHARACTERS = [
    "a lonely dragon",
    "a young baker",
    "an old fisherman",
    "a clever fox",
    "a lost astronaut",
    "a shy giant",
    "a talking tree",
    "a retired detective",
    "a curious penguin",
    "a tiny mouse",
    "a brave librarian",
    "a time traveller",
    "a forgetful wizard",
    "a kind robot",
    "a street cat",
    "two rival chefs",
    "a girl who can hear colours",
    "a ghost in a museum",
    "a travelling musician",
]
_ACTIONS = [
    "finds a map",
    "learns to fly",
    "opens a bakery",
    "makes an unexpected friend",
    "wins a contest",
    "discovers a secret door",
    "loses a shoe",
    "saves a village",
    "plants a garden",
    "writes a letter to the future",
    "gets lost in a city",
    "builds a boat",
]
_EMAILS = [
    "asking a manager for a day off",
    "thanking a teacher",
    "inviting neighbours to a barbecue",
    "asking a landlord to fix the heating",
    "welcoming a new team member",
    "apologizing for missing a meeting",
    "following up after a job interview",
    "asking a friend to return a book",
    "congratulating a colleague on a promotion",
    "cancelling a dentist appointment",
    "introducing yourself to a new client",
    "reminding a team about a deadline",
    "requesting a refund for a late delivery",
]
_TASKS = [
    "make a cup of tea",
    "change a flat tyre",
    "write a to-do list",
    "make pancakes",
    "boil an egg",
    "tie a tie",
    "clean a laptop screen",
    "make a budget",
    "plant tulip bulbs",
    "start a journal",
    "fold a shirt",
    "make a smoothie",
    "back up my phone",
    "iron a shirt",
    "make a paper airplane",
    "cook rice",
    "remove a coffee stain",
    "pack a suitcase",
    "set up a fish tank",
    "make lemonade",
    "choose a good watermelon",
    "sharpen a knife",
]
_CONCEPTS = [
    "gravity",
    "democracy",
    "inflation",
    "a black hole",
    "DNA",
    "a computer virus",
    "renewable energy",
    "the water cycle",
    "an ecosystem",
    "compound interest",
    "a metaphor",
    "the stock market",
    "machine learning",
    "an atom",
    "a calorie",
    "a haiku",
    "evolution",
    "a vaccine",
    "friction",
    "the immune system",
    "a budget deficit",
    "a leap year",
    "a supply chain",
    "an algorithm",
    "erosion",
    "biodiversity",
    "a password manager",
    "jet lag",
    "the placebo effect",
    "a recession",
]
_PAIRS = [
    ("a virus", "a bacterium"),
    ("a lake", "a pond"),
    ("tea", "coffee"),
    ("a crocodile", "an alligator"),
    ("a loan", "a grant"),
    ("speed", "velocity"),
    ("a city", "a town"),
    ("a poem", "a song"),
    ("baking soda", "baking powder"),
    ("a frog", "a toad"),
    ("weather", "a season"),
    ("an ocean", "a sea"),
    ("a rabbit", "a hare"),
    ("a hurricane", "a tornado"),
]
_ANIMALS = [
    ("dogs", "wag their tails"),
    ("birds", "migrate"),
    ("bees", "make honey"),
    ("owls", "hunt at night"),
    ("whales", "sing"),
    ("zebras", "have stripes"),
    ("cows", "chew all day"),
    ("bats", "hang upside down"),
    ("fish", "swim in schools"),
    ("squirrels", "bury nuts"),
    ("horses", "sleep standing up"),
    ("parrots", "copy voices"),
    ("ants", "carry heavy things"),
    ("giraffes", "have long necks"),
]
_NAMES = [
    "a bakery",
    "a bookshop",
    "a flower shop",
    "a bike repair shop",
    "a pet grooming salon",
    "a yoga studio",
    "a food truck",
    "a tea house",
    "a cleaning company",
    "a toy store",
    "a podcast about cooking",
    "a hiking club",
    "a board game cafe",
    "a family restaurant",
]
_AUDIENCES = ["a child", "a teenager", "a grandparent", "a new employee", "a tourist", "a student"]
_PLACES = [
    "Paris",
    "a small island",
    "the mountains",
    "Tokyo",
    "a national park",
    "the seaside",
    "Rome",
    "a farm",
    "New York",
    "a ski resort",
    "a quiet village",
    "Iceland",
    "a rainforest",
]

_TEMPLATES: list[tuple[str, tuple[list, ...]]] = [
    ("What are three tips for {}?", (_ACTIVITIES,)),
    ("Give me five ideas for {}.", (_ACTIVITIES,)),
    ("What mistakes do people often make when {}?", (_ACTIVITIES,)),
    ("Write a short poem about {}.", (_THINGS,)),
    ("Write a haiku about {}.", (_THINGS,)),
    ("Describe {} in a few sentences.", (_THINGS,)),
    ("Explain how {} works, in simple words.", (_PHENOMENA,)),
    ("How would you explain {} to {}?", (_PHENOMENA, _AUDIENCES)),
    ("Tell me a short story about {} who {}.", (_CHARACTERS, _ACTIONS)),
    ("Write the opening paragraph of a story about {}.", (_CHARACTERS,)),
    ("Write a friendly email {}.", (_EMAILS,)),
    ("Write a short, polite message {}.", (_EMAILS,)),
    ("How do I {}?", (_TASKS,)),
    ("Give me step-by-step instructions to {}.", (_TASKS,)),
    ("What is {}?", (_CONCEPTS,)),
    ("Explain {} in one paragraph.", (_CONCEPTS,)),
    ("Why does {} matter in everyday life?", (_CONCEPTS,)),
    ("What is the difference between {} and {}?", (_PAIRS,)),
    ("Why do {} {}?", (_ANIMALS,)),
    ("Suggest a name for {} and explain why.", (_NAMES,)),
    ("Write a slogan for {}.", (_NAMES,)),
    ("Plan a three-day trip to {}.", (_PLACES,)),
    ("What should I pack for a week in {}?", (_PLACES,)),
    ("What are the pros and cons of {}?", (_ACTIVITIES,)),
    ("Give me a fun fact about {}.", (_CONCEPTS,)),
    ("Describe {} from the point of view of {}.", (_THINGS, _CHARACTERS)),
    ("Explain {} to {}.", (_CONCEPTS, _AUDIENCES)),
    ("Write a short story set in {} about {}.", (_PLACES, _CHARACTERS)),
    ("Compare {} and {} as places for a holiday.", (_PLACES, _PLACES)),
]

_PASSAGE_TASKS = [
    "Summarize the following text in two sentences.",
    "Explain the following text to a beginner.",
    "List the key points of the following text.",
    "Rewrite the following text in plain words.",
]


def builtin_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct prompts (fewer if the set has fewer), in a seeded order."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    pool = sorted(_pool())
    random.Random(seed).shuffle(pool)
    return pool[:num_prompts]


def builtin_prompt_count() -> int:
    return len(_pool())


def _pool() -> set[str]:
    return (set(_template_prompts()) | set(_passage_prompts())) - set(_held_out())


def _template_prompts() -> list[str]:
    prompts = []
    for template, slots in _TEMPLATES:
        if len(slots) == 1 and isinstance(slots[0][0], tuple):  # a list of pairs
            prompts += [template.format(*pair) for pair in slots[0]]
        elif len(slots) == 1:
            prompts += [template.format(value) for value in slots[0]]
        else:
            prompts += [template.format(a, b) for a in slots[0] for b in slots[1] if a != b]
    return prompts


def _passage_prompts() -> list[str]:
    """Tasks on the first paragraph of standard-library module docstrings."""
    prompts = []
    for text in _stdlib_paragraphs():
        prompts += [f"{task}\n\n{text}" for task in _PASSAGE_TASKS]
    return prompts


def _stdlib_paragraphs() -> list[str]:
    import importlib
    import sys
    import warnings

    paragraphs = []
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "tkinter", "turtle"}:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that does not import has no text for us
            continue
        doc = (module.__doc__ or "").strip().split("\n\n")[0]
        text = " ".join(doc.split())
        if 80 <= len(text) <= 600 and not text.startswith(("Copyright", "usage", "Usage")):
            paragraphs.append(text)
    return paragraphs


def _held_out() -> list[str]:
    from engine.benchmarks.workloads import BUILTIN

    return [prompt for prompts in BUILTIN.values() for prompt in prompts]


def load_prompt_file(path: str) -> list[str]:
    """One prompt per line, or JSONL objects with a "prompt" field; blank lines skipped."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"--prompts {path}:{number}: a JSON line needs a string 'prompt' field"
                ) from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"--prompts {path}:{number}: 'prompt' must be a non-empty string")
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts
