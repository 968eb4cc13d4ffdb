"""Word lists for the composed instructions of `conversations.py`: tasks, subjects, audiences, lengths, formats,
tones, system prompts and follow-up turns (written for verispec; no dataset content). `topics.py` holds the
domain lists that both prompt builders share."""

# Tasks, each with a {s} slot for the subject.
TASKS = [
    "Explain {s}.", "Give me an overview of {s}.", "What should a beginner know about {s}?",
    "List the pros and cons of {s}.", "What are common misconceptions about {s}?", "Write a short story involving {s}.",
    "Write a poem about {s}.", "Write a haiku sequence about {s}.", "Create a quiz with answers about {s}.",
    "Write a lesson plan for teaching {s}.", "Give five interesting facts about {s}.",
    "Write a dialogue between two friends discussing {s}.", "Describe the history of {s}.",
    "What are the biggest open questions about {s}?", "Write a persuasive paragraph in favour of {s}.",
    "Argue against {s} as a devil's advocate would.", "Compare {s} with something similar and explain the differences.",
    "How would you explain {s} using an analogy?", "Write a tweet thread about {s}.",
    "Draft a newsletter section about {s}.", "What careers involve {s}?", "Brainstorm ten project ideas about {s}.",
    "Write a glossary of key terms related to {s}.", "Summarize the main debates around {s}.",
    "Give a step-by-step guide to getting started with {s}.", "What mistakes do people often make with {s}?",
    "Write a product pitch that uses {s} as a theme.", "Plan a one-week study schedule to learn about {s}.",
    "Write an FAQ about {s}.", "Describe {s} from the point of view of a curious alien.",
    "What would the world look like without {s}?", "Write a limerick about {s}.",
    "Explain how {s} affects everyday life.", "Write interview questions for an expert on {s}.",
    "Tell me a bedtime story that teaches something about {s}.", "Outline a documentary about {s}.",
]

# Subjects beyond topics.TOPICS and topics.SCIENCE_CONCEPTS: everyday life, work, hobbies, technology.
SUBJECTS = [
    "budgeting on a student income", "learning to play the guitar", "composting at home", "training for a 10k run",
    "writing a cover letter", "negotiating a salary", "keeping houseplants alive", "baking bread without yeast",
    "planning a wedding on a budget", "learning a second language as an adult", "time management", "public speaking",
    "starting a podcast", "birdwatching", "home workouts without equipment", "saving for retirement",
    "choosing a laptop", "setting up a home network", "version control with git", "unit testing",
    "SQL joins", "regular expressions", "REST APIs", "containerisation", "password managers", "phishing emails",
    "machine translation", "spreadsheets for small businesses", "remote team meetings", "job interviews",
    "moving to a new city", "adopting a rescue dog", "caring for an elderly parent", "camping in the rain",
    "reducing food waste", "cycling to work", "fermenting vegetables", "knitting", "chess openings", "sudoku",
    "astronomy for amateurs", "street photography", "writing a novel", "meal prepping", "first aid basics",
    "dealing with procrastination", "making friends as an adult", "learning to swim", "buying a used car",
    "renting your first apartment", "open source licences", "data privacy", "electric scooters", "board games",
    "the history of the bicycle", "sign language", "volunteering", "minimalist living", "sleep hygiene",
    "coffee brewing methods", "the metric system", "the history of chess", "beekeeping", "rock climbing",
    "solar eclipses", "the immune system and exercise", "habit formation", "stand-up comedy", "origami",
]

AUDIENCES = [
    "", "", "", " for a ten-year-old", " for a busy executive", " for a complete beginner", " for an expert audience",
    " for a high school class", " for my grandmother", " for a software engineer", " for a non-native English speaker",
]

LENGTHS = [
    "", "", "", " Keep it under 50 words.", " Answer in one sentence.", " Use about three paragraphs.",
    " Be thorough.", " Be brief.", " Use no more than 100 words.", " Give a detailed answer.",
]

FORMATS = [
    "", "", "", " Use a numbered list.", " Use bullet points.", " Format the answer as a table.",
    " Use headings for each part.", " Answer in JSON with the keys \"title\" and \"points\".",
    " End with a one-line summary.", " Include a concrete example.",
]

TONES = [
    "", "", "", " Write in a friendly tone.", " Write formally.", " Make it funny.", " Sound enthusiastic.",
    " Keep a neutral, factual tone.", " Write like a news reporter.", " Use simple words.",
]

# System prompts that some conversations start with (the rest use the chat template's default): a few, so the
# engine's prefix cache shares their KV across many conversations.
SYSTEM_PROMPTS = [
    "You are a concise assistant. Answer in as few words as the question allows.",
    "You are a patient tutor. Explain your reasoning step by step and check the student's understanding.",
    "You are a senior software engineer. Give correct, idiomatic code and explain trade-offs briefly.",
    "You are a friendly travel agent who knows every city well.",
    "You are an assistant for a small bakery. Be warm and practical.",
    "You answer questions for a public library's help line. Be accurate and cite the kind of source to check.",
    "You are a writing coach. Suggest improvements and explain why they help.",
    "You are a careful math assistant. Show the calculation and state the final answer on its own line.",
    "You are a translator. Translate faithfully and note any idioms that do not carry over.",
    "You are an assistant that always answers in valid Markdown.",
    "You are a cheerful assistant for children aged eight to twelve. Use short sentences.",
    "You are a data analyst. Prefer tables and numbers over prose.",
    "You are a history teacher who loves telling anecdotes.",
    "You are a fitness coach. Give safe, realistic advice and suggest seeing a doctor when appropriate.",
    "You are an assistant inside a note-taking app. Keep answers structured and skimmable.",
    "You are a customer support agent for an internet provider. Be polite and solve the problem in steps.",
]

# Follow-up user turns for multi-turn conversations (they refer to the assistant's previous answer).
FOLLOW_UPS = [
    "Can you make that shorter?", "Now explain it as if I were five years old.", "Give me an example.",
    "Turn your answer into a bulleted list.", "What is the most important point in what you said?",
    "Can you expand on the second point?", "Translate your answer into French.", "Write that as a short poem.",
    "Are there any counterarguments?", "Summarize that in one sentence.", "What sources could I read to learn more?",
    "Make it more formal.", "Make it more casual and fun.", "Can you give me three follow-up questions to think about?",
    "What would change if we looked at this fifty years ago?", "Thanks! Can you add a practical tip at the end?",
    "Please rewrite it for a professional audience.", "Can you check your answer for mistakes?",
    "Write a title for what you just wrote.", "How would you explain this to a skeptic?",
]
