"""Held-out prompts for adaptive speculation (issue 29): four kinds, six prompts each, written for
this check and never used to tune the policy (loadtest/workloads.py is what it was tuned on).

Kinds: open chat (little to copy), code editing (most of the answer is in the prompt), extraction
(fields lifted from a given text), summarising (a given text condensed: some phrases copied). The
texts are literal, not read from the installed Python, so the prompts stay the same everywhere.
"""

from __future__ import annotations

from loadtest.workloads import user_prompt_ids

_OPEN_CHAT = [
    "What are some good habits for keeping a small vegetable garden healthy through a dry summer?",
    "I want to start running but I get bored quickly. How can I make it a habit that sticks?",
    "Explain to a curious twelve-year-old why the sky turns orange and red at sunset.",
    "My team keeps missing deadlines. What are a few practical things a new manager could try?",
    "Suggest a simple three-course dinner for friends, one of whom is vegetarian, and say why "
    "each dish works.",
    "What should someone think about before adopting a dog if they live in a small apartment?",
]

_CODE_SNIPPETS = [
    ("Rename the variable `lst` to `values` everywhere in this function, and change nothing else.",
     "def moving_average(lst, window):\n"
     "    if window <= 0:\n"
     "        raise ValueError(\"window must be positive\")\n"
     "    out = []\n"
     "    total = 0.0\n"
     "    for i, x in enumerate(lst):\n"
     "        total += x\n"
     "        if i >= window:\n"
     "            total -= lst[i - window]\n"
     "        if i >= window - 1:\n"
     "            out.append(total / window)\n"
     "    return out\n"),
    ("Add type hints to every parameter and to the return value of this function. Keep the body "
     "exactly as it is.",
     "def merge_intervals(intervals):\n"
     "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
     "    merged = []\n"
     "    for start, end in intervals:\n"
     "        if merged and start <= merged[-1][1]:\n"
     "            merged[-1][1] = max(merged[-1][1], end)\n"
     "        else:\n"
     "            merged.append([start, end])\n"
     "    return merged\n"),
    ("Convert this class to a Python dataclass. Keep the method unchanged.",
     "class Invoice:\n"
     "    def __init__(self, number, customer, amount, paid):\n"
     "        self.number = number\n"
     "        self.customer = customer\n"
     "        self.amount = amount\n"
     "        self.paid = paid\n"
     "\n"
     "    def outstanding(self):\n"
     "        if self.paid:\n"
     "            return 0\n"
     "        return self.amount\n"),
    ("Rewrite this JavaScript function using `const` and `let` instead of `var`, and keep "
     "everything else identical.",
     "function countWords(text) {\n"
     "  var counts = {};\n"
     "  var words = text.toLowerCase().split(/\\s+/);\n"
     "  for (var i = 0; i < words.length; i++) {\n"
     "    var word = words[i];\n"
     "    if (word.length === 0) {\n"
     "      continue;\n"
     "    }\n"
     "    counts[word] = (counts[word] || 0) + 1;\n"
     "  }\n"
     "  return counts;\n"
     "}\n"),
    ("Add a docstring to this function and a comment above the loop. Do not change the code.",
     "def parse_config(lines):\n"
     "    config = {}\n"
     "    for line in lines:\n"
     "        line = line.strip()\n"
     "        if not line or line.startswith(\"#\"):\n"
     "            continue\n"
     "        key, _, value = line.partition(\"=\")\n"
     "        config[key.strip()] = value.strip()\n"
     "    return config\n"),
    ("Replace the print calls in this function with calls to `logger.info`, and keep the rest.",
     "def sync_files(source, target, dry_run=False):\n"
     "    copied = 0\n"
     "    for name in sorted(os.listdir(source)):\n"
     "        src = os.path.join(source, name)\n"
     "        dst = os.path.join(target, name)\n"
     "        if os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):\n"
     "            print(\"skip\", name)\n"
     "            continue\n"
     "        print(\"copy\", name)\n"
     "        if not dry_run:\n"
     "            shutil.copy2(src, dst)\n"
     "        copied += 1\n"
     "    print(\"done,\", copied, \"files copied\")\n"
     "    return copied\n"),
]

_EXTRACTION_TEXTS = [
    ("List every person named in the text below with their role, one per line as "
     "`name: role`.",
     "The meeting was opened by Maria Lopez, the chair of the board, who welcomed the new "
     "treasurer, Daniel Okafor. The secretary, Priya Raman, read the minutes of the last meeting. "
     "Tom Becker, head of facilities, reported that the roof repairs were finished, and Aiko "
     "Tanaka, the volunteer coordinator, asked for help with the spring fair. The meeting was "
     "closed by the vice chair, Samuel Greene."),
    ("Extract the order details from this email as JSON with the keys order_number, items "
     "(name and quantity), delivery_address and delivery_date.",
     "Hello, I would like to confirm order 48213. Please send 3 packs of A4 printer paper, 2 boxes "
     "of blue ballpoint pens, 1 desk lamp with a white shade and 4 spiral notebooks. The delivery "
     "address is 17 Harbour Street, Flat 2, Port Ellen, and we need everything by 14 March. Thank "
     "you, Fiona"),
    ("From the product description below, list each technical specification as `name: value`.",
     "The Trailmaster 40 backpack holds 40 litres and weighs 1.2 kilograms. It is made of "
     "recycled ripstop nylon with a waterproof coating rated at 3000 millimetres. The back panel "
     "is adjustable for torso lengths from 40 to 52 centimetres, the hip belt fits waists from 70 "
     "to 120 centimetres, and the pack comes with a two-year warranty. Available colours are "
     "forest green, slate grey and sunset orange."),
    ("Find every date and what happened on it in the text below, one per line as "
     "`date - event`.",
     "The library closed for renovation on 3 June 2019. Work on the new reading room began on 15 "
     "July 2019, and the children's wing was finished on 2 March 2020. Because of delays, the "
     "opening was moved from 1 May 2020 to 12 September 2020, when the mayor cut the ribbon. On "
     "20 November 2020 the library received an award for its accessible design."),
    ("List every ingredient with its quantity from this recipe, one per line.",
     "To make the soup, soften 2 chopped onions and 3 cloves of garlic in 2 tablespoons of olive "
     "oil. Add 500 grams of red lentils, 1 tin of chopped tomatoes, 1.5 litres of vegetable stock "
     "and 1 teaspoon of ground cumin. Simmer for 25 minutes, then stir in the juice of half a "
     "lemon and a handful of fresh coriander. Season with salt and pepper to taste."),
    ("Extract each error from this log as `time | component | message`, one per line. Ignore "
     "lines that are not errors.",
     "09:14:02 INFO  api      request served in 12 ms\n"
     "09:14:05 ERROR db       connection refused by 10.0.0.7:5432\n"
     "09:14:05 WARN  api      retrying request 5521\n"
     "09:14:09 ERROR cache    eviction failed: key space full\n"
     "09:14:10 INFO  worker   job 881 finished\n"
     "09:14:12 ERROR api      upstream timeout after 3000 ms\n"
     "09:14:15 ERROR worker   job 882 crashed: out of memory\n"),
]

_SUMMARY_TEXTS = [
    "Bees are essential pollinators for many crops, including apples, almonds and blueberries. In "
    "recent decades, beekeepers in several countries have reported unusually large winter losses "
    "of their colonies. Researchers point to a combination of causes: parasitic mites that weaken "
    "the bees, pesticides that affect their navigation, and a loss of wild flowers that provide "
    "varied food. Some farmers now plant strips of flowers beside their fields, and several "
    "governments have restricted the pesticides most strongly linked to harm.",
    "The town council voted on Tuesday to turn the old railway line into a walking and cycling "
    "path. The line closed in 1968 and has been overgrown for decades. Supporters say the path "
    "will connect three villages with the town centre, give children a safe route to school and "
    "bring visitors to local shops. Some residents whose gardens border the line worry about "
    "privacy and noise. The council promised to plant hedges along the route and to consult "
    "neighbours before work begins next spring.",
    "Sleep plays a central role in memory. During deep sleep, the brain replays patterns of "
    "activity from the day, which helps move new information into long-term storage. Studies "
    "show that students who sleep after learning a list of words remember more of them the next "
    "day than students who stay awake for the same time. Lack of sleep also makes it harder to "
    "concentrate, so a tired learner takes in less in the first place. Experts recommend regular "
    "sleep times and avoiding screens late in the evening.",
    "A small software company moved to a four-day working week last year as a trial. Staff kept "
    "their full salaries and were asked to deliver the same work in fewer hours. After six months, "
    "the company reported that output had stayed the same, sick days had fallen by a third, and "
    "fewer people had left. Managers said meetings became shorter and more focused. Some customers "
    "were at first unhappy about the closed day, so the team now keeps a small rota of staff "
    "available on Fridays.",
    "Glaciers in the Alps have lost more than half of their volume since the middle of the "
    "nineteenth century, and the loss has sped up in recent decades. Warmer summers melt more ice "
    "than winter snow can replace. The retreat changes the landscape, exposes unstable rock and "
    "affects rivers that depend on meltwater in late summer. Scientists measure the glaciers each "
    "year with stakes drilled into the ice, satellite images and aerial photographs, and they "
    "expect most small glaciers to disappear by the end of the century.",
    "The museum's new exhibition tells the history of everyday objects, from the wooden spoon to "
    "the smartphone. Each room covers one century and shows how materials, prices and designs "
    "changed. Visitors can handle copies of some objects and listen to recorded memories of older "
    "residents. The curators say the aim is to show that ordinary things reveal how people lived, "
    "worked and cooked. The exhibition runs until the end of October, and entry is free for "
    "children under sixteen.",
]


def _code_editing() -> list[str]:
    return [f"{instruction}\n\n```\n{code}```" for instruction, code in _CODE_SNIPPETS]


def _extraction() -> list[str]:
    return [f"{instruction}\n\n{text}" for instruction, text in _EXTRACTION_TEXTS]


def _summarising() -> list[str]:
    return [f"Summarise the following text in three sentences.\n\n{text}" for text in _SUMMARY_TEXTS]


HELDOUT_PROMPTS: dict[str, list[str]] = {
    "open_chat": list(_OPEN_CHAT),
    "code_editing": _code_editing(),
    "extraction": _extraction(),
    "summarising": _summarising(),
}


def heldout_chat_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of every held-out prompt after the tokenizer's chat template, by kind."""
    return {kind: [user_prompt_ids(tokenizer, message) for message in messages]
            for kind, messages in HELDOUT_PROMPTS.items()}
