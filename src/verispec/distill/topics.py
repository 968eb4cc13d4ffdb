"""Word lists that the prompt templates of `prompts.py` draw from (written for verispec; no dataset content)."""

TOPICS = [
    "volcanoes", "honey bees", "the history of the printing press", "black holes", "coral reefs", "the Roman Empire",
    "machine learning", "climate change", "the human immune system", "renewable energy", "ancient Egypt",
    "the stock market", "photosynthesis", "the Industrial Revolution", "electric cars", "sleep", "the water cycle",
    "social media", "the French Revolution", "vaccines", "plate tectonics", "the internet", "jazz music",
    "the Great Wall of China", "dinosaurs", "inflation", "quantum computing", "the Olympic Games", "tea",
    "coffee", "the Amazon rainforest", "space exploration", "the Renaissance", "recycling", "earthquakes",
    "artificial intelligence", "the human brain", "glaciers", "the Silk Road", "antibiotics", "solar panels",
    "democracy", "the moon landing", "urban gardening", "cryptocurrency", "the ocean tides", "migrating birds",
    "the theory of evolution", "nuclear power", "public libraries", "video games", "chocolate", "the Cold War",
    "electricity", "wind turbines", "the Mediterranean diet", "bicycles", "the Vikings", "hurricanes",
    "remote work", "meditation", "the periodic table", "supply chains", "rainbows", "the Sahara desert",
    "3D printing", "the Beatles", "the Marshall Plan", "gene editing", "tropical fruit", "public transport",
    "the Aztec civilization", "cloud computing", "wolves", "the Nile river", "chess", "typography",
    "the immune response to viruses", "microplastics", "the Apollo program", "soil erosion", "mobile phones",
    "the history of medicine", "minimalism", "the Mars rovers", "folk tales", "sourdough bread", "tsunamis",
]

SCIENCE_CONCEPTS = [
    "superposition", "entropy", "natural selection", "the Doppler effect", "osmosis", "general relativity",
    "the greenhouse effect", "DNA replication", "Newton's third law", "the photoelectric effect", "catalysts",
    "the Krebs cycle", "continental drift", "supply and demand", "opportunity cost", "compound interest",
    "the placebo effect", "cognitive dissonance", "plate boundaries", "half-life", "electromagnetic induction",
    "the central limit theorem", "Bayes' theorem", "recursion", "public-key cryptography", "hash tables",
    "the speed of light", "acid rain", "ocean acidification", "the nitrogen cycle", "mitosis", "buoyancy",
    "friction", "the Coriolis effect", "neural networks", "gradient descent", "the Big Bang", "dark matter",
    "antibiotic resistance", "herd immunity", "photosynthesis", "the carbon cycle", "inflation in economics",
    "comparative advantage", "game theory", "the scientific method", "machine translation", "blockchains",
]

PERSONAS = [
    "a pirate captain", "Sherlock Holmes", "a medieval knight", "a friendly robot", "a famous chef",
    "a travel guide in Rome", "a detective in 1920s Chicago", "an astronaut on the International Space Station",
    "a wise old wizard", "a sports commentator", "a doctor", "a kindergarten teacher", "a startup founder",
    "a marine biologist", "a stand-up comedian", "a museum curator", "a personal fitness coach", "a poet",
    "a car mechanic", "a history professor", "a librarian", "a fashion designer", "a park ranger",
    "a financial advisor", "a mountain climber", "a video game character", "a news reporter", "a barista",
]

CITIES = [
    "Paris", "Tokyo", "New York", "London", "Berlin", "Sydney", "Cairo", "Rio de Janeiro", "Toronto", "Mumbai",
    "Rome", "Madrid", "Lisbon", "Vienna", "Seoul", "Mexico City", "Cape Town", "Istanbul", "Bangkok", "Oslo",
    "Chicago", "Nairobi", "Buenos Aires", "Amsterdam", "Prague", "Dublin", "Singapore", "Hanoi", "Lima", "Munich",
]

COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Germany", "Kenya", "Australia", "Mexico", "Italy",
    "Spain", "Norway", "Argentina", "South Korea", "Vietnam", "Peru", "Turkey", "Ireland", "Portugal", "Chile",
    "Greece", "Sweden", "Thailand", "Nigeria", "Poland", "New Zealand", "Morocco", "Iceland", "Indonesia",
]

EVENTS = [
    "a new bridge opening", "a city council vote on bike lanes", "a heat wave", "a local football club winning the cup",
    "a museum exhibition of ancient coins", "a tech company announcing layoffs", "a river flood",
    "a school introducing a four-day week", "a record-breaking marathon", "a rare bird sighting",
    "a power outage", "a new high-speed rail line", "a music festival", "a hospital opening a new wing",
    "a scientific discovery about a distant planet", "a fire at a historic theatre", "a strike by train drivers",
    "a central bank raising interest rates", "a charity raising money for refugees", "an election result",
    "a new law on plastic bags", "a celebrity wedding", "a drought affecting farmers", "a cyber attack on a bank",
    "a rescue of hikers in the mountains", "the launch of a satellite", "a food festival", "a zoo welcoming a baby panda",
    "a court ruling on privacy", "a startup raising funding", "a storm cancelling flights", "a new vaccine trial",
]

PRODUCTS = [
    "smartphone", "electric scooter", "laptop", "coffee maker", "fitness tracker", "pair of running shoes",
    "smart speaker", "e-reader", "camera", "electric toothbrush", "backpack", "mattress", "air purifier",
]

NAMES = [
    "Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Isabel", "James", "Kofi", "Lena", "Marco",
    "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Xena", "Yusuf", "Zoe",
    "John", "Mary", "Tom", "Lisa", "Mike", "Sarah", "Ali", "Jen", "Carlos", "Mei",
]

ITEMS = [
    ("apple", "apples", 0.5), ("notebook", "notebooks", 3), ("cupcake", "cupcakes", 2), ("pencil", "pencils", 1),
    ("ticket", "tickets", 12), ("book", "books", 8), ("shirt", "shirts", 15), ("plant", "plants", 6),
    ("cookie", "cookies", 1), ("toy car", "toy cars", 4), ("bottle of juice", "bottles of juice", 2),
    ("bag of rice", "bags of rice", 9), ("flower", "flowers", 2), ("video game", "video games", 40),
    ("sandwich", "sandwiches", 5), ("candle", "candles", 3), ("egg", "eggs", 0.25), ("marble", "marbles", 0.1),
]

CODING_TASKS = [
    "tells if a number is prime", "reverses a string", "finds the largest element in a list",
    "counts the vowels in a string", "computes the factorial of a number", "returns the n-th Fibonacci number",
    "tells if a string reads the same backwards", "merges two sorted lists", "removes duplicates from a list",
    "finds the most common word in a text", "converts Celsius to Fahrenheit", "sorts a list with bubble sort",
    "implements binary search", "flattens a nested list", "counts the words in a file",
    "computes the greatest common divisor of two numbers", "validates an email address with a regular expression",
    "finds the second largest number in an array", "reads a CSV file and prints the average of a column",
    "implements a stack class", "implements a queue using two stacks", "tells if two strings are anagrams",
    "computes the sum of the digits of a number", "finds all prime numbers below n", "transposes a matrix",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "implements a simple linked list", "counts the frequency of each character in a string",
    "returns the median of a list of numbers", "tells if a year is a leap year",
    "finds the intersection of two lists", "generates all permutations of a string", "computes x to the power n",
    "finds the longest word in a sentence", "implements quicksort", "rotates a list by k positions",
]

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust", "C"]

QA_FACTS = {
    "Who wrote {}?": [
        "Romeo and Juliet", "Pride and Prejudice", "the Odyssey", "Don Quixote", "War and Peace", "Hamlet",
        "the Great Gatsby", "Moby Dick", "Frankenstein", "the Little Prince", "1984", "Jane Eyre", "Dracula",
        "the Divine Comedy", "Oliver Twist", "the Origin of Species", "the Hobbit", "Les Miserables",
    ],
    "Who invented {}?": [
        "the telephone", "the light bulb", "the printing press", "the airplane", "the World Wide Web",
        "the steam engine", "penicillin", "the radio", "the bicycle", "the television", "dynamite", "the telescope",
    ],
    "What is the capital of {}?": COUNTRIES,
    "Where is {} located?": [
        "the Eiffel Tower", "Mount Everest", "the Taj Mahal", "Machu Picchu", "the Colosseum", "Stonehenge",
        "the Golden Gate Bridge", "the Great Barrier Reef", "Angkor Wat", "the Dead Sea", "Niagara Falls",
    ],
    "When did {} happen?": [
        "the first moon landing", "the fall of the Berlin Wall", "the French Revolution", "World War I",
        "the sinking of the Titanic", "the signing of the Magna Carta", "the first Olympic Games",
    ],
    "How many {}?": [
        "planets are in the solar system", "bones are in the human body", "players are on a soccer team",
        "strings does a violin have", "states are in the United States", "continents are there",
        "teeth does an adult human have", "keys are on a piano", "days are in a leap year", "sides does a hexagon have",
    ],
    "What is {}?": [
        "the largest ocean", "the tallest mountain in Africa", "the longest river in Europe", "the speed of sound",
        "the boiling point of water", "the largest planet", "the smallest country in the world", "a light year",
        "the chemical symbol for gold", "the main ingredient of guacamole", "the currency of Japan",
    ],
    "Who played {}?": [
        "the lead role in the first Harry Potter film", "James Bond in the 1960s", "the joker in the dark knight",
        "captain jack sparrow", "the main character in forrest gump", "rose in titanic", "neo in the matrix",
    ],
    "When was {} released?": [
        "the first iphone", "the movie jurassic park", "the first star wars movie", "windows 95",
        "the song bohemian rhapsody", "the game minecraft", "the first harry potter book",
    ],
    "Who sings {}?": [
        "the song hallelujah", "bohemian rhapsody", "rolling in the deep", "shake it off", "yesterday",
        "billie jean", "purple rain", "hotel california",
    ],
    "Why is {}?": [
        "the sky blue", "the sea salty", "ice slippery", "the grass green", "the moon visible during the day",
    ],
}

# German sentence parts for translation prompts (news-style, like a WMT test set; composed, not copied).
DE_SUBJECTS = [
    "Der Bürgermeister", "Die Regierung", "Ein Sprecher der Polizei", "Die Bundeskanzlerin", "Der Trainer",
    "Die Firma", "Ein junger Mann", "Die Lehrerin", "Der Präsident", "Die Stadtverwaltung", "Das Unternehmen",
    "Die Forscher", "Viele Anwohner", "Der Verein", "Die Ärztin", "Der Autor", "Die Schüler", "Das Gericht",
]
DE_VERBS = [
    "hat am Montag angekündigt, dass", "erklärte am Dienstag, dass", "sagte gegenüber Journalisten, dass",
    "teilte in einer Pressemitteilung mit, dass", "betonte, dass", "kritisierte, dass", "hofft, dass",
    "befürchtet, dass", "bestätigte am Wochenende, dass", "hat nicht ausgeschlossen, dass",
]
DE_CLAUSES = [
    "die Preise im nächsten Jahr steigen werden", "das neue Stadion bis 2026 fertig sein soll",
    "die Schulen wegen des Sturms geschlossen bleiben", "mehr Geld in den Klimaschutz investiert wird",
    "die Verhandlungen noch mehrere Wochen dauern könnten", "der Spieler wegen einer Verletzung ausfällt",
    "die Zahl der Touristen deutlich gestiegen ist", "viele Familien sich die Mieten nicht mehr leisten können",
    "die Bahn ab Dezember häufiger fahren wird", "die Ergebnisse der Studie überraschend seien",
    "der Flughafen wegen Nebels gesperrt wurde", "die Arbeitslosigkeit im Sommer gesunken ist",
    "das Museum eine neue Ausstellung über die Römer zeigt", "die Polizei zwei Verdächtige festgenommen hat",
    "die Brücke dringend saniert werden muss", "der Vertrag um drei Jahre verlängert wurde",
]
DE_STANDALONE = [
    "In der Nacht zum Sonntag hat es in {city} heftig geregnet .",
    "Nach dem Spiel feierten die Fans bis in die frühen Morgenstunden .",
    "Die Wirtschaft in {country} wächst langsamer als erwartet .",
    "Vergessen Sie nicht , rechtzeitig Ihre Fahrkarte zu kaufen .",
    "Im Winter ist die Straße oft wegen Schnee gesperrt .",
    "Der Film erzählt die Geschichte einer Familie , die nach {city} auswandert .",
    "Mehr als {n} Menschen haben an der Demonstration teilgenommen .",
    "Das Hotel liegt direkt am Strand und bietet einen schönen Blick auf das Meer .",
    "Die Mannschaft verlor das Auswärtsspiel mit 0:{k} .",
    "Wer in {city} wohnt , muss mit hohen Mieten rechnen .",
    "Die neue App soll Patienten helfen , schneller einen Termin beim Arzt zu bekommen .",
    "Seit {k} Jahren arbeitet sie als Krankenschwester in einem Krankenhaus in {city} .",
    "Es ist wichtig , genug Wasser zu trinken , besonders bei großer Hitze .",
    "Die Preise für Strom und Gas sind im letzten Jahr stark gestiegen .",
    "Die Kinder spielen jeden Nachmittag im Park hinter der Schule .",
]
DE_CITIES = ["Berlin", "Hamburg", "München", "Köln", "Frankfurt", "Stuttgart", "Dresden", "Leipzig", "Bremen", "Mainz"]
DE_COUNTRIES = ["Deutschland", "Österreich", "der Schweiz", "Frankreich", "Italien", "Spanien", "Polen"]

FR_SENTENCES = [
    "Le gouvernement a annoncé de nouvelles mesures pour protéger l'environnement .",
    "Les enfants jouent dans le jardin pendant que leurs parents préparent le dîner .",
    "La ville de {city} accueille chaque année des milliers de touristes .",
    "Il fait très beau aujourd'hui , alors nous allons à la plage .",
    "Le musée sera fermé pendant trois semaines pour des travaux .",
]
ES_SENTENCES = [
    "El presidente visitará {city} la próxima semana para reunirse con empresarios .",
    "Me gusta leer un libro antes de dormir .",
    "Los precios de la vivienda han subido mucho en los últimos años .",
    "El equipo ganó el partido gracias a un gol en el último minuto .",
]
