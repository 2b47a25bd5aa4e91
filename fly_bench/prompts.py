"""The prompts the measurements share, in one place: a figure in one file and a figure in another
were measured on the same text when they name the same prompt here.

TASKS are the one-prompt measurements' kinds (code repeats itself and the drafter guesses it
well; prose and math less so); QUESTIONS are short chat questions; COMPLETIONS are raw code
openers for the Serve overhead runs and Locust; SWEEP_CHATS are the load sweep's chats; SOAK the
soak's mix of raw and chat text."""

TASKS = {
    "code": "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals given as a "
    "list of [start, end] pairs and returns them sorted. Include a docstring and a few doctest examples.",
    "math": "Solve step by step: a train leaves at 9:40 and travels 180 km at 72 km/h, then waits 15 minutes "
    "and travels another 96 km at 64 km/h. At what time does it arrive? Show each calculation.",
    "prose": "Explain to a new engineer, in a few plain paragraphs, what a race condition is, how one shows up "
    "in a web service, and the usual ways to prevent it.",
    "c": "Write a C function that reverses a singly linked list in place, with a short comment on each step and a "
    "main() that tests it on a list of five nodes.",
}
# A prompt whose answer rewrites its input (most of the output is in the prompt: prompt lookup's
# best case), and one in another language than the model's mostly English code training.
TASKS["rewrite"] = (
    "Add type hints to this Python function and change nothing else; reply with the whole function.\n\n"
    "```python\n"
    "def summarize_orders(orders, currency, min_total=0):\n"
    "    totals = {}\n"
    "    for order in orders:\n"
    "        if order['currency'] != currency:\n"
    "            continue\n"
    "        customer = order['customer']\n"
    "        amount = sum(item['price'] * item['quantity'] for item in order['items'])\n"
    "        totals[customer] = totals.get(customer, 0) + amount\n"
    "    result = []\n"
    "    for customer, total in sorted(totals.items(), key=lambda kv: kv[1], reverse=True):\n"
    "        if total >= min_total:\n"
    "            result.append({'customer': customer, 'total': round(total, 2)})\n"
    "    return result\n"
    "```"
)
TASKS["multilingual"] = (
    "Erkläre auf Deutsch in einem kurzen Absatz, was eine Hashtabelle ist, und nenne zwei typische Anwendungen."
)
CODE = TASKS["code"]

QUESTIONS = [
    "Reverse a string in Python.",
    "Explain what a hash map is in two sentences.",
    "Write a bash loop that prints 1 to 10.",
    "Write a Python class for a stack with push and pop.",
    "What is the difference between a list and a tuple in Python?",
    "Write a C function that sums an array.",
    "Write a regex that matches an email address.",
    "Write a JavaScript debounce function.",
    "Explain recursion to a beginner.",
    "Write a Python function that flattens a nested list.",
]

COMPLETIONS = [
    'def quicksort(arr):\n    """Sort a list with quicksort."""\n',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'class Stack:\n    """A LIFO stack backed by a list."""\n',
    "def is_prime(n: int) -> bool:\n",
    'def read_csv(path):\n    """Read a CSV file into a list of dicts."""\n',
    "def binary_search(xs, target):\n",
    "def word_count(text: str) -> dict[str, int]:\n",
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
]

SWEEP_CHATS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and punctuation.",
    "Explain in three sentences what a hash table is.",
    "Write a short paragraph about why the sky is blue.",
    "Write a Python class `Stack` with push, pop and peek.",
    "Describe the water cycle for a ten-year-old in a few sentences.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Give three tips for writing clear emails.",
]

SOAK = [
    "def quicksort(arr):\n",
    "def fibonacci(n):\n    ",
    "class Stack:\n    def push(self, x):\n",
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in one sentence.",
    "def merge_sorted(a, b):\n",
]
