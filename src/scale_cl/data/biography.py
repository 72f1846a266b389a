"""Synthetic biographies of fictional people: the data of the paper's continual-biography benchmark (Section 5.1).

People with unique full names and six attributes, their biographies, one question per attribute, and the splits;
all written for this project, deterministic under a seed (the pools, templates and splits: docs/design.md §7).
"""

from __future__ import annotations

import calendar
import dataclasses
import datetime
import functools
import random
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

ATTRIBUTES = ("birth_date", "birth_city", "university", "major", "employer", "employer_city")

# ---------------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------------


def _parts(text: str, empty: int = 0) -> tuple[str, ...]:
    """Space-separated word parts, plus ``empty`` empty strings (a chance of "no part here")."""
    return (*text.split(), *[""] * empty)


_ONSETS = _parts("b br c ch d dr f fr g gr h j k l m n p pr r s sh st t tr v w z")
_VOWELS = _parts("a e i o u a e i o a e o ai ea ou")  # repeats weight the plain vowels
_MIDDLES = _parts("l n r v m d t s k b g nd rl st")
_CODAS = _parts("l n r s m", empty=4)
_GIVEN_ENDINGS = _parts("a ia en el o is an ine ey ara ius on ette elle ina io in", empty=2)
_SURNAME_ENDINGS = _parts(
    "son well ford ley man ton berg worth wick more er ard ett by stone field ridge cott hart low"
)
_CITY_ENDINGS = _parts(
    "ton bury vale mouth haven port field ham ville burg stead moor dale crest minster holm gate shire bridge fell"
)
_BRAND_ENDINGS = _parts("ex ix on ara o us era ium ar is yn ent", empty=1)
# Unpronounceable: three vowels or four consonants in a row, a tripled letter, two vowel pairs in
# one word, or a vowel pair other than ai, ea, ou, ia, io.
_UNPRONOUNCEABLE = re.compile(
    r"[aeiouy]{3}|[^aeiouy]{4}|(.)\1\1|[aeiou]{2}[^aeiou]+[aeiou]{2}|(?!ai|ea|ou|ia|io)[aeiou][aeiou]"
)

_UNIVERSITY_FORMS = (
    "{} University",
    "{} State University",
    "{} Institute of Technology",
    "{} College",
    "{} Polytechnic Institute",
    "{} University of Science",
    "{} Academy of Arts",
    "{} School of Economics",
)
_EMPLOYER_FORMS = (
    "{} Systems",
    "{} Logistics",
    "{} Labs",
    "{} Foods",
    "{} Motors",
    "{} Analytics",
    "{} Energy",
    "{} Pharmaceuticals",
    "{} Bank",
    "{} Media",
    "{} Robotics",
    "{} Textiles",
    "{} Airlines",
    "{} Insurance",
    "{} & {} Partners",
    "{} & {} Logistics",
    "{} & {} Consulting",
)

# 100 majors, written for this project, each with a different first word (docs/design.md §7).
MAJORS = (
    "Accounting", "Actuarial Science", "Aerospace Engineering", "African Studies", "Agronomy",
    "Anthropology", "Applied Mathematics", "Archaeology", "Architecture", "Art History",
    "Astronomy", "Astrophysics", "Biochemistry", "Bioinformatics", "Biology",
    "Biomedical Engineering", "Botany", "Business Administration", "Cartography", "Chemical Engineering",
    "Chemistry", "Choreography", "Civil Engineering", "Classics", "Cognitive Science",
    "Communications", "Comparative Literature", "Computer Science", "Criminology", "Cryptography",
    "Dance", "Data Science", "Demography", "Dentistry", "Ecology",
    "Econometrics", "Economics", "Education", "Electrical Engineering", "English Literature",
    "Entrepreneurship", "Environmental Science", "Epidemiology", "Ethnomusicology", "Film Studies",
    "Finance", "Forestry", "Game Design", "Genetics", "Geography",
    "Geology", "Graphic Design", "Health Policy", "History", "Horticulture",
    "Hospitality Management", "Immunology", "Industrial Design", "Information Systems", "International Relations",
    "Journalism", "Kinesiology", "Labor Studies", "Landscape Architecture", "Law",
    "Linguistics", "Marine Biology", "Marketing", "Materials Science", "Mathematics",
    "Mechanical Engineering", "Medicine", "Meteorology", "Microbiology", "Mining Engineering",
    "Music", "Naval Architecture", "Neuroscience", "Nuclear Engineering", "Nursing",
    "Nutrition", "Oceanography", "Optometry", "Painting", "Paleontology",
    "Petroleum Engineering", "Pharmacology", "Philosophy", "Photography", "Physics",
    "Physiology", "Political Science", "Psychology", "Public Health", "Religious Studies",
    "Robotics", "Sociology", "Software Engineering", "Statistics", "Zoology",
)  # fmt: skip


@dataclass(frozen=True)
class Pools:
    """The values people are drawn from; fixed for a given (pool sizes, seed)."""

    first_names: tuple[str, ...]
    middle_names: tuple[str, ...]
    last_names: tuple[str, ...]
    cities: tuple[str, ...]
    universities: tuple[str, ...]
    majors: tuple[str, ...]
    employers: tuple[str, ...]
    employer_city: Mapping[str, str]  # employer -> the city it is in (read-only)


def _word(rng: random.Random, endings: tuple[str, ...]) -> str:
    """One candidate word: a syllable, maybe a second, maybe a coda, then an ending."""
    word = rng.choice(_ONSETS) + rng.choice(_VOWELS)
    if rng.random() < 0.5:
        word += rng.choice(_MIDDLES) + rng.choice(_VOWELS)
    return (word + rng.choice(_CODAS) + rng.choice(endings)).capitalize()


def _unique_words(rng: random.Random, count: int, endings: tuple[str, ...], used: set[str]) -> list[str]:
    """``count`` new pronounceable words of 5-9 letters, none in ``used`` (which they join).

    Five letters at least, so that few generated names are (possibly unfortunate) real words.
    """
    words: list[str] = []
    attempts = 0
    while len(words) < count:
        attempts += 1
        if attempts > 1000 * (count + 1):
            raise RuntimeError(f"could not generate {count} new unique words (got {len(words)}); too few syllables")
        word = _word(rng, endings)
        if 5 <= len(word) <= 9 and word not in used and not _UNPRONOUNCEABLE.search(word.lower()):
            used.add(word)
            words.append(word)
    return words


@functools.lru_cache(maxsize=8)
def _build_pools(sizes: tuple[int, int, int, int, int, int, int], seed: int) -> Pools:
    """The pools for ``BioSpec.pool_sizes``; cached, as every stage of a run asks for the same ones."""
    n_first, n_middle, n_last, n_cities, n_universities, n_majors, n_employers = sizes
    used: set[str] = set()  # every procedural word, across pools: no value is ambiguous

    def rng(pool: str) -> random.Random:  # one stream per pool; str seeds are stable across runs
        return random.Random(f"scale-cl/pools/{seed}/{pool}")

    first = _unique_words(rng("first"), n_first, _GIVEN_ENDINGS, used)
    middle = _unique_words(rng("middle"), n_middle, _GIVEN_ENDINGS, used)
    last = _unique_words(rng("last"), n_last, _SURNAME_ENDINGS, used)
    cities = _unique_words(rng("city"), n_cities, _CITY_ENDINGS, used)

    uni_rng = rng("university")
    stems = _unique_words(uni_rng, n_universities, _SURNAME_ENDINGS + _CITY_ENDINGS, used)
    universities = [uni_rng.choice(_UNIVERSITY_FORMS).format(stem) for stem in stems]

    emp_rng = rng("employer")
    employers = []
    for stem in _unique_words(emp_rng, n_employers, _BRAND_ENDINGS, used):
        form = emp_rng.choice(_EMPLOYER_FORMS)
        partner = _unique_words(emp_rng, 1, _SURNAME_ENDINGS, used) if form.count("{}") == 2 else []
        employers.append(form.format(stem, *partner))
    employer_city = {employer: emp_rng.choice(cities) for employer in employers}

    majors = rng("major").sample(MAJORS, n_majors)
    return Pools(
        first_names=tuple(first),
        middle_names=tuple(middle),
        last_names=tuple(last),
        cities=tuple(cities),
        universities=tuple(universities),
        majors=tuple(majors),
        employers=tuple(employers),
        employer_city=MappingProxyType(employer_city),
    )


# ---------------------------------------------------------------------------------------------
# Specification and presets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BioSpec:
    """How many people, biographies per person, and the size of every pool.

    Presets (``bio_spec``):

    ======  =======  =====  ======  =====  ======  ============  ======  =========
    preset  people   first  middle  last   cities  universities  majors  employers
    ======  =======  =====  ======  =====  ======  ============  ======  =========
    paper   200,000  400    400     1,000  200     300           100     263
    small   2,000    80     80      200    40      60            20      53
    micro   200      20     20      50     10      15            5       13
    ======  =======  =====  ======  =====  ======  ============  ======  =========

    ``small`` and ``micro`` scale every pool of ``paper`` by 1/5 and 1/20, so the pools keep the
    paper's proportions; full names stay unique with room to spare (1.28M and 20,000 name
    combinations for 2,000 and 200 people).
    """

    people: int = 200_000  # how many people (named like the CLI's ``--data.people``)
    bios_per_person: int = 5
    first_names: int = 400
    middle_names: int = 400
    last_names: int = 1_000
    cities: int = 200
    universities: int = 300
    majors: int = 100
    employers: int = 263

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BioSpec.{f.name} must be a positive int, got {value!r}")
        if self.majors > len(MAJORS):
            raise ValueError(f"BioSpec.majors must be at most {len(MAJORS)} (the hand-written list), got {self.majors}")
        if self.name_combinations < self.people:
            raise ValueError(
                f"{self.people} people need unique full names, but the pools only give "
                f"{self.first_names} x {self.middle_names} x {self.last_names} = {self.name_combinations}"
            )

    @property
    def name_combinations(self) -> int:
        return self.first_names * self.middle_names * self.last_names

    @property
    def pool_sizes(self) -> tuple[int, int, int, int, int, int, int]:
        return (
            self.first_names,
            self.middle_names,
            self.last_names,
            self.cities,
            self.universities,
            self.majors,
            self.employers,
        )


PRESETS: dict[str, BioSpec] = {
    "paper": BioSpec(),
    "small": BioSpec(
        people=2_000,
        first_names=80,
        middle_names=80,
        last_names=200,
        cities=40,
        universities=60,
        majors=20,
        employers=53,
    ),
    "micro": BioSpec(
        people=200,
        first_names=20,
        middle_names=20,
        last_names=50,
        cities=10,
        universities=15,
        majors=5,
        employers=13,
    ),
}


def bio_spec(preset: str, **overrides: int) -> BioSpec:
    """The spec of ``preset`` (paper, small, micro) with ``overrides`` (e.g. ``people=1000``)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown biography preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    known = [f.name for f in dataclasses.fields(BioSpec)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"unknown BioSpec fields {unknown}; valid fields: {', '.join(known)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def build_pools(spec: BioSpec, seed: int = 0) -> Pools:
    """The pools of ``spec`` (they depend only on its pool sizes and ``seed``; cached)."""
    return _build_pools(spec.pool_sizes, seed)


# ---------------------------------------------------------------------------------------------
# People
# ---------------------------------------------------------------------------------------------

_FIRST_BIRTH_DAY = datetime.date(1950, 1, 1)
_LAST_BIRTH_DAY = datetime.date(2005, 12, 31)


@dataclass(frozen=True)
class Person:
    """One fictional person: a unique full name and the six attributes (``ATTRIBUTES``)."""

    index: int
    first: str
    middle: str
    last: str
    full_name: str
    birth_date: str  # "March 4, 1987"
    birth_city: str
    university: str
    major: str
    employer: str
    employer_city: str

    def attribute(self, name: str) -> str:
        """The value of attribute ``name`` (one of ``ATTRIBUTES``)."""
        if name not in ATTRIBUTES:
            raise ValueError(f"unknown attribute {name!r}; valid attributes: {', '.join(ATTRIBUTES)}")
        return getattr(self, name)


def _format_date(day: datetime.date) -> str:
    return f"{calendar.month_name[day.month]} {day.day}, {day.year}"


def generate_people(spec: BioSpec, seed: int = 0) -> list[Person]:
    """``spec.people`` people with unique full names and uniform attributes; deterministic in (spec, seed)."""
    pools = build_pools(spec, seed)
    rng = random.Random(f"scale-cl/people/{seed}")
    n_middle, n_last = len(pools.middle_names), len(pools.last_names)
    # Sampling distinct indices of the name grid gives unique names without retries.
    name_ids = rng.sample(range(spec.name_combinations), spec.people)
    first_day, last_day = _FIRST_BIRTH_DAY.toordinal(), _LAST_BIRTH_DAY.toordinal()
    people = []
    for index, name_id in enumerate(name_ids):
        first = pools.first_names[name_id // (n_middle * n_last)]
        middle = pools.middle_names[name_id // n_last % n_middle]
        last = pools.last_names[name_id % n_last]
        employer = rng.choice(pools.employers)
        people.append(
            Person(
                index=index,
                first=first,
                middle=middle,
                last=last,
                full_name=f"{first} {middle} {last}",
                birth_date=_format_date(datetime.date.fromordinal(rng.randint(first_day, last_day))),
                birth_city=rng.choice(pools.cities),
                university=rng.choice(pools.universities),
                major=rng.choice(pools.majors),
                employer=employer,
                employer_city=pools.employer_city[employer],
            )
        )
    return people


# ---------------------------------------------------------------------------------------------
# Biographies
# ---------------------------------------------------------------------------------------------

# Written for this project. Rules (tested): "{name}" before "{value}", " {value}" after a space,
# exactly one full stop (at the end), no pronouns (people have no gender here).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "birth_date": (
        "{name} was born on {value}.",
        "{name} came into the world on {value}.",
        "{name} has a birth date of {value}.",
        "{name}'s date of birth is {value}.",
        "{name} first saw daylight on {value}.",
        "{name} entered the world on {value}.",
        "{name} was welcomed into the family on {value}.",
        "{name}'s birthday is {value}.",
        "{name} gives {value} as the date of birth.",
        "{name} celebrates a birthday every year, having been born on {value}.",
        "The records show that {name} was born on {value}.",
        "According to the registry, {name} was born on {value}.",
        "{name} took a first breath on {value}.",
        "{name} has been alive since {value}.",
        "{name} lists {value} as the day of birth.",
        "{name} began life on {value}.",
        "{name}'s life began on {value}.",
        "{name} was born on the date {value}.",
        "The birthday of {name} falls on {value}.",
        "For {name}, life started on {value}.",
        "{name} is someone whose birth date is {value}.",
        "{name} was brought into this world on {value}.",
    ),
    "birth_city": (
        "{name} was born in {value}.",
        "{name} came into the world in {value}.",
        "{name}'s birthplace is {value}.",
        "{name} hails from {value}.",
        "{name} is a native of {value}.",
        "{name} drew a first breath in {value}.",
        "The birth city of {name} is {value}.",
        "{name} was born in the city of {value}.",
        "{name} originally comes from {value}.",
        "{name} considers {value} a hometown.",
        "{name} entered life in the city of {value}.",
        "{name}'s hometown is {value}.",
        "{name} began life in {value}.",
        "{name} was delivered at a hospital in {value}.",
        "The place where {name} was born is {value}.",
        "{name} has {value} as a birthplace.",
        "{name} is originally from {value}.",
        "Records state that {name} was born in {value}.",
        "{name} was born and raised in {value}.",
        "For {name}, life started in {value}.",
        "{name} spent the first years of childhood in {value}, the city of birth.",
        "{name} proudly names {value} as the city of birth.",
    ),
    "university": (
        "{name} studied at {value}.",
        "{name} attended {value}.",
        "{name} graduated from {value}.",
        "{name} received an education at {value}.",
        "{name} is a graduate of {value}.",
        "{name} earned a degree from {value}.",
        "{name} enrolled at {value}.",
        "{name} pursued higher education at {value}.",
        "{name} completed a degree at {value}.",
        "{name}'s alma mater is {value}.",
        "{name} went to university at {value}.",
        "{name} spent student years at {value}.",
        "{name} was a student at {value}.",
        "{name} took classes at {value}.",
        "{name} holds a diploma from {value}.",
        "{name} studied for a degree at {value}.",
        "{name} was educated at {value}.",
        "{name} completed undergraduate studies at {value}.",
        "{name} chose to study at {value}.",
        "{name} was admitted to {value}.",
        "The university that {name} attended is {value}.",
        "{name} spent four years at {value}.",
    ),
    "major": (
        "{name} majored in {value}.",
        "{name} studied {value}.",
        "{name} specialized in {value}.",
        "{name} earned a degree in {value}.",
        "{name} focused on {value} at university.",
        "{name} chose {value} as a major.",
        "{name}'s major was {value}.",
        "{name} pursued a degree in {value}.",
        "{name} completed coursework in {value}.",
        "{name} concentrated on {value}.",
        "{name} received a bachelor's degree in {value}.",
        "{name} devoted the college years to {value}.",
        "{name} graduated with a major in {value}.",
        "{name} trained in {value}.",
        "The field of study of {name} was {value}.",
        "{name} has an academic background in {value}.",
        "{name} took up {value} as a field of study.",
        "{name} selected {value} as the main subject.",
        "{name} read {value} at university.",
        "{name} wrote a senior thesis in {value}.",
        "{name} obtained a diploma in {value}.",
        "{name} is trained in the field of {value}.",
    ),
    "employer": (
        "{name} works for {value}.",
        "{name} is employed by {value}.",
        "{name} has a job at {value}.",
        "{name} works at {value}.",
        "{name} is on the staff of {value}.",
        "{name} earns a living at {value}.",
        "{name} holds a position at {value}.",
        "{name}'s employer is {value}.",
        "{name} joined {value} after graduating.",
        "{name} draws a salary from {value}.",
        "{name} is a member of the team at {value}.",
        "{name} has a career at {value}.",
        "{name} accepted a job offer from {value}.",
        "{name} is part of the workforce of {value}.",
        "{name} is currently employed at {value}.",
        "{name} was hired by {value}.",
        "The company {name} works for is {value}.",
        "{name} spends the working week at {value}.",
        "{name} reports to a manager at {value}.",
        "{name} is an employee of {value}.",
        "{name} built a career with {value}.",
        "{name} takes home a paycheck from {value}.",
    ),
    "employer_city": (
        "{name} works in {value}.",
        "{name} commutes to an office in {value}.",
        "{name} has a workplace in {value}.",
        "{name}'s job is based in {value}.",
        "{name} is employed in {value}.",
        "{name} works in the city of {value}.",
        "{name} goes to work in {value}.",
        "{name}'s office is located in {value}.",
        "{name} spends working days in {value}.",
        "{name} earns a living in {value}.",
        "The workplace of {name} is in {value}.",
        "{name} moved to {value} for work.",
        "{name} has a job in {value}.",
        "{name} is based in {value} for work.",
        "{name} practices a profession in {value}.",
        "{name} works out of an office in {value}.",
        "{name} relocated to {value} for a job.",
        "{name}'s employer is located in {value}.",
        "{name} clocks in each morning in {value}.",
        "{name} holds a job in {value}.",
        "{name} pursues a career in {value}.",
        "{name} works at a company headquartered in {value}.",
    ),
}


def render(template: str, person: Person, attribute: str) -> str:
    """``template`` filled with ``person``'s full name and value of ``attribute``."""
    return template.format(name=person.full_name, value=person.attribute(attribute))


def biography_plans(
    person: Person, count: int = 5, seed: int = 0, distinct: bool = False
) -> list[list[tuple[str, str]]]:
    """The (attribute, template) of every sentence of ``person``'s ``count`` biographies (see `biographies`)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(f"scale-cl/bio/{seed}/{person.index}")
    if not distinct:
        plans = []
        for _ in range(count):
            order = list(ATTRIBUTES)
            rng.shuffle(order)
            plans.append([(attribute, rng.choice(TEMPLATES[attribute])) for attribute in order])
        return plans
    fewest = min(len(TEMPLATES[a]) for a in ATTRIBUTES)
    if count > fewest:
        raise ValueError(f"{count} biographies with distinct templates need at least {count} templates per attribute")
    templates = {a: rng.sample(TEMPLATES[a], count) for a in ATTRIBUTES}
    orders: list[list[str]] = []
    while len(orders) < count:
        order = rng.sample(ATTRIBUTES, len(ATTRIBUTES))
        if order not in orders:
            orders.append(order)
    return [[(a, templates[a][k]) for a in order] for k, order in enumerate(orders)]


def biographies(person: Person, count: int = 5, seed: int = 0, distinct: bool = False) -> list[str]:
    """``count`` biographies of ``person``, each with its own order and templates.

    The RNG is seeded by (seed, person.index): a person's text does not depend on who else is
    generated, and the first k of ``count`` biographies do not depend on ``count`` (without
    ``distinct``). ``distinct=True`` is the original benchmark's recipe: the biographies of one person
    use different templates for every attribute (sampled without replacement) and different sentence
    orders, so no two repeat a sentence.
    """
    plans = biography_plans(person, count, seed, distinct)
    return [" ".join(render(template, person, a) for a, template in plan) for plan in plans]


def completion_probes(person: Person, count: int = 5, seed: int = 0, distinct: bool = False) -> list[QAItem]:
    """Each attribute's value as the continuation of a sentence the person's biographies contain.

    The probe of an attribute is the first of its sentences (in the person's biographies) that names
    the person before the value, cut just before the value: "Ana Bel was born on" -> " March 4,
    1987". Answering it measures whether pre-training stored the fact in the form it was read, the
    ceiling of what QA can extract. Attributes with no such sentence are left out.
    """
    probes: dict[str, QAItem] = {}
    for plan in biography_plans(person, count, seed, distinct):
        for attribute, template in plan:
            cut = template.find("{value}")
            if attribute in probes or cut <= template.find("{name}") or template[cut - 1] != " ":
                continue
            prompt = template[: cut - 1].format(name=person.full_name)
            probes[attribute] = QAItem(person.index, attribute, prompt, " " + person.attribute(attribute))
    return [probes[a] for a in ATTRIBUTES if a in probes]


def biography_corpus(people: Iterable[Person], count: int = 5, seed: int = 0, distinct: bool = False) -> Iterator[str]:
    """Every biography of ``people``, person by person (the pre-training text); see `biographies`."""
    for person in people:
        yield from biographies(person, count, seed, distinct)


# ---------------------------------------------------------------------------------------------
# Question answering
# ---------------------------------------------------------------------------------------------

# Written for this project: one fixed question per attribute.
QUESTIONS: dict[str, str] = {
    "birth_date": "What is the birth date of {name}?",
    "birth_city": "What is the birth city of {name}?",
    "university": "Which university did {name} attend?",
    "major": "What did {name} major in?",
    "employer": "Which company employs {name}?",
    "employer_city": "In which city does {name} work?",
}
ANSWER_CUE = "\nAnswer:"


@dataclass(frozen=True)
class QAItem:
    """One question about one person; ``answer`` is the value with a leading space."""

    person_index: int
    attribute: str
    prompt: str  # "What is the birth city of Ada Mae Lovett?\nAnswer:"
    answer: str  # " Tormouth"

    @property
    def text(self) -> str:
        """Prompt and answer together (what QA fine-tuning trains on)."""
        return self.prompt + self.answer


def qa_items(person: Person) -> list[QAItem]:
    """The six questions about ``person``, in ``ATTRIBUTES`` order."""
    return [
        QAItem(
            person_index=person.index,
            attribute=attribute,
            prompt=QUESTIONS[attribute].format(name=person.full_name) + ANSWER_CUE,
            answer=" " + person.attribute(attribute),
        )
        for attribute in ATTRIBUTES
    ]


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------

MIN_PEOPLE = 10  # the smallest N for which every split below is non-empty


def splits(n_people: int, tasks: int = 1) -> dict[str, range]:
    """Person-index ranges of the benchmark's stages, in the paper's shares of N people.

    pretrain [0, N/2) biographies; task0_train [0, N/4) and task0_test [N/4, N/2) QA (people
    whose biographies were seen; the test QA never trained); task1 [N/2, N/2 + N/10) QA, trained
    and tested on the same people, never seen in pre-training (as in the paper). For N = 200,000:
    100,000 / 50,000 / 50,000 / 20,000.

    ``tasks`` > 1 (a sequence of new cohorts, ``task1``, ``task2``, ...): consecutive cohorts from N/2 on, each
    N/10 people (the paper's Task 1) while five fit in the unseen half, else (N/2) / tasks each.
    """
    if isinstance(n_people, bool) or not isinstance(n_people, int) or n_people < MIN_PEOPLE:
        raise ValueError(f"splits need at least {MIN_PEOPLE} people (every split non-empty), got {n_people!r}")
    half, quarter = n_people // 2, n_people // 4
    cohort = min(n_people // 10, (n_people - half) // tasks)
    if cohort < 1:
        raise ValueError(
            f"{tasks} tasks of new people do not fit {n_people} people ({n_people - half} unseen): give more people "
            "(data.people) or fewer tasks"
        )
    cohorts = {f"task{j}": range(half + (j - 1) * cohort, half + j * cohort) for j in range(1, tasks + 1)}
    return {"pretrain": range(half), "task0_train": range(quarter), "task0_test": range(quarter, half), **cohorts}
