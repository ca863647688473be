"""The prompts of `kvpool bench codec`: varied on purpose (chat, code, arithmetic, facts, lists,
translation, instructions, long documents), so the KV a codec is tried on covers what a serving
pool holds. The last few are long (several 256-token chunks) and built from the others."""

from __future__ import annotations

SHORT = [
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences what a hash table is.",
    "Translate into French: 'The library opens at nine and closes at five on weekdays.'",
    "List five fruits that are red when ripe.",
    "What is 17 multiplied by 23? Show your steps.",
    "Give me three tips for sleeping better.",
    "Who wrote 'Pride and Prejudice', and in which century was it published?",
    "Write a haiku about autumn rain.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What does HTTP status code 404 mean?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Write a SQL query that counts the orders per customer in a table named orders.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Name the planets of the solar system in order from the sun.",
    "Describe how to make a cup of green tea.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short, polite email declining a meeting invitation for Friday.",
]

MEDIUM = [
    ("Here is a function:\n\n```python\ndef merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and "
     "j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            "
     "out.append(b[j]); j += 1\n    out.extend(a[i:]); out.extend(b[j:])\n    return out\n```\n\nWhat does it do, "
     "what is its time complexity, and what happens if the inputs are not sorted?"),
    ("A train leaves the station at 3:15 pm travelling at 80 km/h. A second train leaves the same station at "
     "4:00 pm on a parallel track travelling at 110 km/h in the same direction. At what time does the second "
     "train catch up with the first, and how far from the station are they then? Explain each step."),
    ("Our team keeps missing deadlines. Meetings run long, tickets are vague, and reviews sit for days. We are "
     "six engineers and one product manager, working remotely across three time zones. Suggest a concrete plan "
     "for the next month, with the changes ordered by how quickly they pay off."),
    ("Read this review and say whether it is positive or negative, and why: 'The hotel was in a great location "
     "and the staff were friendly, but the room was tiny, the air conditioning rattled all night, and breakfast "
     "ran out of everything by eight. I would not stay again at this price.'"),
]


def long_prompts() -> list[str]:
    """Documents of several chunks, made of the prompts above (so nothing is downloaded)."""
    everything = SHORT + MEDIUM
    return [
        "Here are some questions people asked an assistant today:\n\n" + "\n\n".join(SHORT) +
        "\n\nGroup them by topic and say which topic came up most often.",
        "Notes from a study group:\n\n" + "\n\n".join(MEDIUM) + "\n\n" + "\n".join(SHORT[:9]) +
        "\n\nWrite a one-paragraph summary of these notes.",
        "Proofread the following text and list any mistakes you find:\n\n" + " ".join(reversed(everything)),
        "Answer the last question only, ignoring the rest:\n\n" + "\n".join(everything[::2]) + "\n" + MEDIUM[1],
        "Context:\n" + "\n".join(MEDIUM) + "\n\nUsing only the context above, what is the merge function for, "
        "and what should the team in the third note do first?",
        "Translate each line into Spanish:\n" + "\n".join(SHORT),
    ]


def prompts() -> list[str]:
    """All prompts: 18 short, 4 medium, 6 long (28)."""
    return SHORT + MEDIUM + long_prompts()
