"""The built-in model's test prompts, shared by the engine tests and their fixtures."""

SYSTEM_PROMPT = (
    "You are a careful assistant for a test suite. Answer in the language of the question, "
    "keep answers short and factual, prefer plain sentences over lists, and never mention "
    "that you are an AI model unless you are asked about it directly."
)

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 50.",
    "What does a paged KV cache do in an LLM server?",
    "Translate 'good morning, my friend' into Spanish.",
    "¿Cuál es el río más largo de Sudamérica?",
    "Écris une phrase sur la mer en hiver.",
    "Was ist die Hauptstadt von Österreich?",
    "用一句话介绍一下长城。",
    "日本の首都はどこですか？",  # noqa: RUF001 - Japanese text's own question mark
    "Что такое фотосинтез? Ответь кратко.",
    "Write a Python function that reverses a string.",
    "What is 17 multiplied by 23?",
    "Give me a short motivational quote about learning.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Name two differences between a cat and a dog.",
    "How many continents are there, and which is the largest?",
    "Describe the smell of rain using an emoji and a word: 🌧️",
    "What is the boiling point of water at sea level in Fahrenheit?",
]
