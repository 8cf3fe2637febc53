"""The package's own small Spanish corpus, generated from a seeded grammar written for aura_hpc.

Not copied from anywhere: hand-written vocabulary and sentence patterns with gender and
number agreement, so a tiny model has real structure to learn in a minute of CPU time.
"""

from __future__ import annotations

import random

CORPUS_VERSION = "aura-es-v1"

# (noun, gender) — m / f
_PEOPLE = [
    ("molinero", "m"),
    ("panadera", "f"),
    ("maestro", "m"),
    ("médica", "f"),
    ("pastor", "m"),
    ("pescadora", "f"),
    ("labrador", "m"),
    ("viajera", "f"),
    ("herrero", "m"),
    ("costurera", "f"),
    ("caballero", "m"),
    ("escudera", "f"),
    ("cura", "m"),
    ("posadera", "f"),
    ("arriero", "m"),
    ("estudiante", "f"),
    ("barbero", "m"),
    ("vecina", "f"),
    ("capitán", "m"),
    ("abuela", "f"),
]
_THINGS = [
    ("camino", "m"),
    ("puerta", "f"),
    ("libro", "m"),
    ("carta", "f"),
    ("caballo", "m"),
    ("ventana", "f"),
    ("molino", "m"),
    ("casa", "f"),
    ("río", "m"),
    ("plaza", "f"),
    ("pan", "m"),
    ("mesa", "f"),
    ("campo", "m"),
    ("noche", "f"),
    ("viento", "m"),
    ("montaña", "f"),
    ("pueblo", "m"),
    ("lámpara", "f"),
    ("barco", "m"),
    ("canción", "f"),
    ("jardín", "m"),
    ("llave", "f"),
    ("huerto", "m"),
    ("fuente", "f"),
    ("sombrero", "m"),
]
_ADJ = [  # masculine singular form; feminine derived
    "viejo",
    "nuevo",
    "blanco",
    "oscuro",
    "pequeño",
    "largo",
    "tranquilo",
    "antiguo",
    "hermoso",
    "cansado",
    "alegre",
    "valiente",
    "verde",
    "triste",
    "claro",
    "frío",
]
_PLACES = [
    "en la aldea",
    "junto al río",
    "en el mercado",
    "al pie de la sierra",
    "en la venta del camino",
    "cerca del molino",
    "en la plaza mayor",
    "bajo los olivos",
    "en la orilla del mar",
    "en la biblioteca",
    "detrás de la iglesia",
    "en el puerto",
    "al otro lado del puente",
    "en la cocina",
    "entre los trigales",
]
_TIMES = [
    "Al amanecer",
    "Aquella tarde",
    "Durante el invierno",
    "Cada mañana",
    "A la hora de la cena",
    "Muchos años después",
    "En primavera",
    "Al caer la noche",
    "Un domingo de agosto",
    "De pronto",
    "Mientras llovía",
    "Antes del alba",
    "Después de la feria",
    "Aquel verano",
    "A mediodía",
]
# (infinitive-ish label, present 3s, past 3s, present 3p, past 3p, takes object)
_VERBS = [
    ("ver", "mira", "miró", "miran", "miraron", True),
    ("buscar", "busca", "buscó", "buscan", "buscaron", True),
    ("abrir", "abre", "abrió", "abren", "abrieron", True),
    ("cerrar", "cierra", "cerró", "cierran", "cerraron", True),
    ("llevar", "lleva", "llevó", "llevan", "llevaron", True),
    ("pintar", "pinta", "pintó", "pintan", "pintaron", True),
    ("encontrar", "encuentra", "encontró", "encuentran", "encontraron", True),
    ("cuidar", "cuida", "cuidó", "cuidan", "cuidaron", True),
    ("vender", "vende", "vendió", "venden", "vendieron", True),
    ("recordar", "recuerda", "recordó", "recuerdan", "recordaron", True),
    ("caminar", "camina", "caminó", "caminan", "caminaron", False),
    ("cantar", "canta", "cantó", "cantan", "cantaron", False),
    ("dormir", "duerme", "durmió", "duermen", "durmieron", False),
    ("esperar", "espera", "esperó", "esperan", "esperaron", False),
    ("trabajar", "trabaja", "trabajó", "trabajan", "trabajaron", False),
    ("reír", "ríe", "rió", "ríen", "rieron", False),
]
_SAYINGS = [
    "Quien madruga, encuentra el camino despejado.",
    "No hay prisa que no espere al pan recién hecho.",
    "El que escucha al río aprende a esperar.",
    "Más vale una vela encendida que mil quejas a oscuras.",
    "Cada molino muele con el viento que le toca.",
]
_OPENINGS = [
    "Esta es la historia de {a} {p} que vivía {pl}.",
    "Nadie en el pueblo sabía por qué {a2} {p} {v_past} {o} aquella vez.",
    "Se cuenta que {a} {p} {adj_p} llegó {pl} con {o}.",
]
_PROSE = """Los modelos de lenguaje aprenden a predecir la palabra siguiente. Con pocos datos y un
modelo pequeño, lo primero que aprenden son las letras más frecuentes, después las palabras
cortas y, con paciencia, el orden de las frases.

Entrenar en dos portátiles conectados por la red de casa es posible. Cada máquina ejecuta una
parte del trabajo y, al final de cada paso, ambas comparten sus gradientes para que el modelo
sea el mismo en las dos.

Cuando el trabajo crece, el mismo programa se lanza en un clúster con muchas tarjetas gráficas.
Los puntos de control guardan el estado del entrenamiento, y si algo falla, el trabajo continúa
desde el último punto guardado sin perder lo aprendido."""


def _article(gender: str, definite: bool, plural: bool = False) -> str:
    if definite:
        return {("m", False): "el", ("f", False): "la", ("m", True): "los", ("f", True): "las"}[(gender, plural)]
    return {("m", False): "un", ("f", False): "una", ("m", True): "unos", ("f", True): "unas"}[(gender, plural)]


def _agree(adj: str, gender: str, plural: bool = False) -> str:
    if gender == "f" and adj.endswith("o"):
        adj = adj[:-1] + "a"
    if plural:
        adj = adj + ("s" if adj[-1] in "aeo" else "es")
    return adj


def _plural(noun: str) -> str:
    if noun[-1] in "aeiouéó":
        return noun + "s"
    if noun.endswith("ón"):
        return noun[:-2] + "ones"
    if noun.endswith("ín"):
        return noun[:-2] + "ines"
    if noun.endswith("án"):
        return noun[:-2] + "anes"
    return noun + "es"


def _object(rng: random.Random, allow_plural: bool = True) -> str:
    noun, g = rng.choice(_THINGS)
    plural = allow_plural and rng.random() < 0.25
    art = _article(g, rng.random() < 0.7, plural)
    word = _plural(noun) if plural else noun
    if rng.random() < 0.5:
        return f"{art} {word} {_agree(rng.choice(_ADJ), g, plural)}"
    return f"{art} {word}"


def _sentence(rng: random.Random) -> str:
    person, g = rng.choice(_PEOPLE)
    plural = rng.random() < 0.2
    subject = f"{_article(g, True, plural)} {_plural(person) if plural else person}"
    _label, p3s, past3s, p3p, past3p, transitive = rng.choice(_VERBS)
    past = rng.random() < 0.6
    verb = (past3p if past else p3p) if plural else (past3s if past else p3s)
    kind = rng.random()
    body = f"{subject} {verb} {_object(rng)}" if transitive else f"{subject} {verb}"
    if kind < 0.35:
        body = f"{rng.choice(_TIMES)}, {body} {rng.choice(_PLACES)}"
    elif kind < 0.6:
        body = f"{body} {rng.choice(_PLACES)}"
    elif kind < 0.75:
        adj = _agree(rng.choice(_ADJ), g, plural)
        ser = ("estaban" if past else "están") if plural else ("estaba" if past else "está")
        body = f"{body}, porque {ser} {adj}"
    elif kind < 0.85:
        return f"—¿Dónde está {_object(rng, allow_plural=False)}? —preguntó {_article(g, True)} {person}."
    body = body[0].upper() + body[1:]
    return body + "."


def _paragraph(rng: random.Random) -> str:
    parts: list[str] = []
    if rng.random() < 0.15:
        person, g = rng.choice(_PEOPLE)
        parts.append(
            rng.choice(_OPENINGS).format(
                a=_article(g, False),
                a2=_article(g, True),
                p=person,
                pl=rng.choice(_PLACES),
                v_past=rng.choice(_VERBS)[2],
                o=_object(rng),
                adj_p=_agree(rng.choice(_ADJ), g),
            )
        )
    parts += [_sentence(rng) for _ in range(rng.randint(2, 6))]
    if rng.random() < 0.05:
        parts.append(rng.choice(_SAYINGS))
    return " ".join(parts)


def generate(n_paragraphs: int = 4000, seed: int = 2024) -> str:
    rng = random.Random(seed)
    paragraphs = [_PROSE] + [_paragraph(rng) for _ in range(n_paragraphs)]
    return "\n\n".join(paragraphs) + "\n"
