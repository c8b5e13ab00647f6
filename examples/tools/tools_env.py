"""The tools of the example: a calculator and a lookup table, offered to the model by a `ToolEnvironment`
(docs/environments.md). The table's countries and capitals are made up, so no model knows them: calling
`capital` is the only way to answer a question about them, and `multiply` of two-digit numbers is beyond a tiny
model's arithmetic. The reward is 1 for a final answer equal to the row's `answer`, else 0.
"""

from tidyrl.environments import ToolEnvironment


# Made-up countries and capitals, each name 5 tokens long for the example's tokenizer, so that copying one (from the
# question into a call, from a result into the answer) is the same move every time: a 2-layer model learns it in a
# few hundred SFT steps.
CAPITALS = {
    "Martorki": "Kivuis", "Ixbagi": "Dortelis", "Sabator": "Baosa", "Baulix": "Ultora", "Gihoul": "Ixtora",
    "Pragiro": "Kibais", "Lunero": "Nequia", "Hodorro": "Sahoov", "Ulsagi": "Hovuis", "Neulix": "Ulosis",
    "Kiulqui": "Ulosa", "Dorkitor": "Ulgia", "Bagiix": "Lupraa", "Rokine": "Marixa", "Nequiro": "Sahois",
    "Gisaho": "Saluov", "Zandorro": "Fentora", "Rokitor": "Saquiis", "Zantorqui": "Marvua", "Marbaul": "Pralua",
    "Torgine": "Ixquiis", "Luvuro": "Kitoris", "Savuro": "Quiula", "Satormar": "Hosaa", "Houlpra": "Roneov",
    "Marnetor": "Vugiis", "Ixhomar": "Gibais", "Torullu": "Tormara", "Kivumar": "Ulquia", "Marsalu": "Rosais",
    "Dorroba": "Saprais", "Ulroix": "Hotelis", "Dorbator": "Torhoa", "Rosagi": "Givua", "Neulos": "Vuprais",
    "Vurodor": "Baulov", "Kibator": "Baixa", "Homarlu": "Giquiis", "Osmarul": "Ulgiis", "Dorsaul": "Ulneis",
    "Osnero": "Vuosis", "Giulix": "Quitora", "Hobane": "Nekia", "Osrotor": "Samara", "Roultel": "Vuquiis",
    "Negiki": "Kitorov", "Nemarqui": "Tormaris", "Vunesa": "Bavuis", "Gimarho": "Ixtelis", "Luroqui": "Luixis",
    "Gitorba": "Luosis", "Marulos": "Baluov", "Osrolu": "Torvuis", "Baluix": "Ulpraa", "Sabalu": "Lumarov",
    "Roulvu": "Ulbais", "Satorho": "Dorhoov", "Osulba": "Torkia", "Vuquine": "Vuquia", "Quiroos": "Kitelis",
    "Dornero": "Lusaa", "Hoquisa": "Hokiis", "Oskine": "Torluis", "Torgimar": "Nequiis", "Margitel": "Oslua",
    "Luosro": "Hodora", "Ixgisa": "Ulsaa", "Marbator": "Dorgia", "Dorulix": "Dorbaa", "Homarqui": "Baixis",
    "Saquitor": "Osgia", "Kiquisa": "Ixhoa", "Kirodor": "Torsaa", "Ulbaro": "Ixhoov", "Dorroul": "Torvua",
    "Marsator": "Saixa", "Satorki": "Roixis", "Kitordor": "Kiosis", "Rogisa": "Rogiis", "Osbaul": "Ixlua",
}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def capital(country: str) -> str:
    """The capital city of a country.

    Args:
        country: the country's name
    """
    return CAPITALS[country]


class Tools(ToolEnvironment):
    tools = (multiply, capital)

    def reward(self, messages):  # the finished conversation: its last message is the model's answer
        return float(messages[-1]["content"].strip() == str(self.row["answer"]))
