"""The text int8 smoothing is calibrated on (kernels/quant.py): a few chat exchanges of
ordinary kinds (explanation, code, a list, arithmetic, a letter), written for this file.
Outlier channels of an LLM's activations are properties of the model more than of its
input, so a short, varied text finds them; it is not the text quality is measured on
(bench/data/perplexity.txt)."""

from __future__ import annotations

from typing import Any

EXCHANGES = [
    (
        "How does a refrigerator keep food cold?",
        "A refrigerator moves heat from the inside of the box to the room around it. A "
        "compressor squeezes a refrigerant gas, which heats it up; the hot gas gives its heat "
        "to the air through the coils at the back and condenses into a liquid. The liquid then "
        "passes through a narrow valve into the coils inside, where the pressure drops, it "
        "evaporates, and evaporating takes heat from the food and the air in the box. The gas "
        "returns to the compressor and the cycle starts again.",
    ),
    (
        "Write a Python function that returns the n-th Fibonacci number.",
        "Here is an iterative version, which runs in linear time:\n\n```python\n"
        "def fibonacci(n: int) -> int:\n    if n < 0:\n        raise ValueError('n must be "
        "non-negative')\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n```\n\nFor example, fibonacci(10) returns 55.",
    ),
    (
        "Give me five tips for a job interview.",
        "1. Research the company and the role before you go.\n2. Prepare short stories that "
        "show how you solved real problems.\n3. Arrive ten minutes early.\n4. Ask the "
        "interviewer two or three thoughtful questions.\n5. Send a brief thank-you note the "
        "same day.",
    ),
    (
        "If a train leaves at 14:20 and the journey takes 2 hours and 55 minutes, when does "
        "it arrive?",
        "Add the hours first: 14:20 plus 2 hours is 16:20. Then add 55 minutes: 16:20 plus 40 "
        "minutes is 17:00, and 15 more minutes gives 17:15. The train arrives at 17:15.",
    ),
    (
        "Draft a short email to a landlord about a broken heater.",
        "Subject: Heater not working in flat 3B\n\nDear Ms. Okafor,\n\nThe heater in the "
        "living room of flat 3B stopped working on Tuesday evening. It makes a clicking sound "
        "but does not warm up. Could you arrange for someone to look at it this week? I am at "
        "home after 5 pm on weekdays.\n\nThank you,\nDaniel Reyes",
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is the state of the atmosphere at a given place and time: today's "
        "temperature, rain or wind. Climate is the pattern of weather over many years, such "
        "as the average rainfall of a region in July. In short, weather is what you get on a "
        "particular day, and climate is what you expect over decades.",
    ),
    (
        "Translate 'Where is the nearest train station?' into French and Spanish.",
        "French: Où est la gare la plus proche ?\nSpanish: ¿Dónde está la estación de tren "
        "más cercana?",
    ),
    (
        "Summarise the causes of the French Revolution in three sentences.",
        "By the late 1780s the French crown was deeply in debt after costly wars, and its "
        "attempts to raise taxes met resistance from the privileged nobility and clergy. Poor "
        "harvests pushed bread prices up, while Enlightenment ideas about rights and popular "
        "sovereignty spread among the middle classes. When the Estates-General met in 1789, "
        "the Third Estate declared itself a National Assembly, and the crisis became a "
        "revolution.",
    ),
    (
        "Explain what a hash table is to a beginner programmer.",
        "A hash table stores pairs of keys and values so that you can find a value by its key "
        "very quickly. It keeps an array of slots, and a hash function turns each key into a "
        "number that picks a slot. To look a key up, you hash it and go straight to its slot "
        "instead of searching the whole collection. Two keys can land in the same slot, a "
        "collision, so each slot holds a short list, or the table probes the next free slot. "
        "Python's dict and JavaScript's Map are hash tables.",
    ),
    (
        "Write a SQL query that lists the ten customers who spent the most in 2023.",
        "```sql\nSELECT c.id, c.name, SUM(o.total) AS spent\nFROM customers AS c\nJOIN "
        "orders AS o ON o.customer_id = c.id\nWHERE o.created_at >= '2023-01-01'\n  AND "
        "o.created_at < '2024-01-01'\nGROUP BY c.id, c.name\nORDER BY spent DESC\nLIMIT "
        "10;\n```",
    ),
    (
        "My tomato plants have yellow leaves at the bottom. What should I do?",
        "Yellowing of the lowest leaves is common and often harmless: older leaves are shaded "
        "and the plant moves nutrients away from them. Remove the yellow leaves so that air "
        "can circulate. If the yellowing climbs the plant, check the watering first, since "
        "both too much and too little cause it, then feed with a balanced fertiliser rich in "
        "nitrogen and magnesium. Brown spots with yellow rings suggest early blight; take off "
        "affected leaves and water the soil, not the foliage.",
    ),
    (
        "Convert 72 degrees Fahrenheit to Celsius and show the steps.",
        "Use C = (F - 32) x 5 / 9. First subtract 32: 72 - 32 = 40. Then multiply by 5: "
        "40 x 5 = 200. Finally divide by 9: 200 / 9 = 22.2. So 72 °F is about 22.2 °C.",
    ),
]


def token_batches(tokenizer: Any, max_len: int) -> list[list[int]]:
    """Each exchange as token ids, through the chat template when the tokenizer has one, cut
    to `max_len` (the engine's max_model_len: no position past its rotary table)."""
    batches = []
    for question, answer in EXCHANGES:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        else:
            ids = tokenizer(f"{question}\n{answer}", add_special_tokens=True)["input_ids"]
        batches.append(list(ids)[:max_len])
    return batches
