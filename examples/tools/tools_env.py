"""The tools of the example: a calculator and a lookup table, offered to the model by a `ToolEnvironment`
(docs/environments.md). The table's countries and capitals are made up, so no model knows them: calling `capital`
is the only way to answer a question about them, and `multiply` of two-digit numbers is beyond a tiny model's
arithmetic. The reward is 1 for a final answer equal to the row's `answer`, else 0.
"""

from tidyrl.environments import ToolEnvironment


# Made-up countries and capitals, each name 5 tokens long for the example's tokenizer, so that copying one (from the
# question into a call, from a result into the answer) is the same move every time.
CAPITALS = {
    "Martorki": "Satelis", "Ixbagi": "Luulov", "Sabator": "Osroov", "Baulix": "Marvuis", "Gihoul": "Osvuis",
    "Pragiro": "Fentora", "Lunero": "Zansais", "Hodorro": "Quiulis", "Ulsagi": "Luvuis", "Neulix": "Marbais",
    "Kiulqui": "Torbaa", "Dorkitor": "Dormara", "Bagiix": "Torhoa", "Rokine": "Dorroov", "Nequiro": "Luixis",
    "Gisaho": "Margiov", "Zandorro": "Dorquiis", "Rokitor": "Netelis", "Zantorqui": "Dorbaa", "Marbaul": "Badora",
    "Torgine": "Praroov", "Luvuro": "Lutela", "Savuro": "Vutela", "Satormar": "Bahoov", "Houlpra": "Praluis",
    "Marnetor": "Neosa", "Ixhomar": "Bapraa", "Torullu": "Bavua", "Kivumar": "Torsais", "Marsalu": "Vuquia",
    "Dorroba": "Ixkiis", "Ulroix": "Vumarov", "Dorbator": "Hovuis", "Rosagi": "Uldora", "Neulos": "Fenrois",
    "Vurodor": "Samara", "Kibator": "Vugiis", "Homarlu": "Kitorov", "Osmarul": "Sadora", "Dorsaul": "Ixtelis",
    "Osnero": "Dorhois", "Giulix": "Ulluis", "Hobane": "Torixis", "Osrotor": "Rodora", "Roultel": "Netoris",
    "Negiki": "Ixgia", "Nemarqui": "Vupraa", "Vunesa": "Dormaris", "Gimarho": "Zanroa", "Luroqui": "Roquia",
    "Gitorba": "Sabais", "Marulos": "Luprais", "Osrolu": "Pralua", "Baluix": "Nevuis", "Sabalu": "Marlua",
    "Roulvu": "Nekiis", "Satorho": "Ixmara", "Osulba": "Kitela", "Vuquine": "Pragiis", "Quiroos": "Satorov",
    "Dornero": "Dorixa", "Hoquisa": "Ulroov", "Oskine": "Telulis", "Torgimar": "Marixa", "Margitel": "Vuhoa",
    "Luosro": "Fensaa", "Ixgisa": "Ulkiis", "Marbator": "Marsaa", "Dorulix": "Giosis", "Homarqui": "Gikiis",
    "Saquitor": "Givua", "Kiquisa": "Dorquia", "Kirodor": "Bamaris", "Ulbaro": "Mardora", "Dorroul": "Zantelis",
    "Marsator": "Telrois", "Satorki": "Ossais", "Kitordor": "Kiquia", "Rogisa": "Lugia", "Osbaul": "Dorlua",
    "Baosro": "Marhoa", "Baullu": "Kitoris", "Ixtorro": "Bamara", "Fengimar": "Dorsaa", "Robaki": "Rovua",
    "Marosix": "Roixis", "Ixdorul": "Giulov", "Kivulu": "Bakia", "Hovulu": "Ixvuis", "Zanulro": "Osgiis",
    "Houlos": "Fenulis", "Girolu": "Lusais", "Horoqui": "Prarois", "Sanetor": "Marluis", "Torgiul": "Luneis",
    "Hosalu": "Dortela", "Fentorro": "Ulosa", "Vubalu": "Vusaa", "Luquimar": "Zanulis", "Salutel": "Vukiis",
    "Ulvuro": "Hoixa", "Praroul": "Zangia", "Vulutel": "Kigia", "Kiultel": "Lutora", "Torbaro": "Luosa",
    "Kitormar": "Neixa", "Quiroba": "Kiosa", "Vuullu": "Fengiis", "Luultel": "Kihois", "Dorsalu": "Hoquiis",
    "Vupralu": "Marosis", "Quimartor": "Roulov", "Negivu": "Ullua", "Fenromar": "Bavuis", "Vupraul": "Oshoov",
    "Vubaul": "Zangiis", "Nesapra": "Giixa", "Vukiul": "Dorosa", "Barogi": "Roixa", "Ixmarul": "Ixquia",
    "Saulgi": "Vuixa", "Torquine": "Tortela", "Bamartor": "Dorhoa", "Ixosul": "Ixneis", "Oskitor": "Torneis",
    "Martorix": "Giluis", "Roosvu": "Ixdora", "Romartel": "Dorkia", "Sanemar": "Vuhois", "Baluos": "Marixis",
    "Dorneul": "Ixbais", "Marneul": "Samaris", "Bagidor": "Osvua", "Hoosvu": "Osbaa", "Dornemar": "Vuroov",
    "Hodorul": "Vugia", "Batorlu": "Ulquia", "Balusa": "Giixis", "Satelul": "Kiquiis", "Hokiul": "Hogia",
    "Kiulsa": "Tormaris", "Pralumar": "Lukia", "Osixgi": "Ixulov", "Ixhone": "Gihois", "Torvuul": "Lusaa",
    "Saixro": "Basaa", "Tortelro": "Dorneis", "Nemarba": "Gibais", "Baroki": "Baosis", "Ulsator": "Ulgia",
    "Baixul": "Fengia", "Quiroul": "Nequiis", "Batorne": "Ulixis", "Dorrotel": "Ixroov", "Ulrosa": "Quineis",
    "Roneix": "Torroov", "Tormarul": "Baulov", "Marnegi": "Marosa", "Lumarsa": "Dorgia", "Kineho": "Kimarov",
    "Oslumar": "Nebais", "Sahoul": "Neixis", "Houltel": "Luroov", "Fensaro": "Rohois", "Torroqui": "Praula",
    "Nesamar": "Martorov", "Vugimar": "Roquiis", "Bavuul": "Vuosa", "Ulgine": "Marquia", "Margidor": "Gihoov",
    "Netorho": "Rolua", "Hobapra": "Osluis", "Saquimar": "Vubais", "Ulrone": "Marvua", "Torosro": "Hoixis",
    "Ulvumar": "Ixsaa", "Vurotel": "Ostorov", "Bauldor": "Luosis", "Gisaix": "Ultela", "Saluvu": "Nevua",
    "Zangisa": "Holua", "Martelul": "Markiis", "Girotor": "Ixkia", "Ronelu": "Marsais", "Margilu": "Marhois",
    "Kisavu": "Torsaa", "Luulne": "Batoris", "Zansaul": "Marneis", "Osnetor": "Zantorov", "Ulnemar": "Zantoris",
    "Vuhoba": "Ulmaris", "Salugi": "Osulov", "Ulostor": "Saneis", "Vugitor": "Vutelis", "Marroba": "Lumarov",
    "Hobaix": "Vuosis", "Kihoul": "Nebaa", "Marulvu": "Saosis", "Hosagi": "Romarov", "Ulrovu": "Quirois",
    "Hogiul": "Ostoris", "Bakimar": "Baprais", "Romarlu": "Dorbais", "Torsaul": "Lupraa", "Robaqui": "Rohoa",
    "Satordor": "Roluis", "Roosne": "Rotora", "Quimarro": "Basais", "Hozantor": "Lukiis", "Kineos": "Rokiis",
    "Dorzantor": "Torulov", "Kigisa": "Quitora", "Luhoba": "Ulsaa", "Roosmar": "Fendora", "Giulba": "Dortora",
    "Luprator": "Bakiis", "Mardorro": "Batela", "Kidorro": "Batorov", "Ulsaro": "Dorkiis", "Ixkisa": "Ulosis",
    "Gisaki": "Bahois", "Ixnegi": "Torixa", "Ixrotor": "Hotora", "Oskisa": "Sakia", "Torvumar": "Vuluov",
    "Zantorho": "Vutora", "Batorqui": "Vusais", "Robamar": "Kihoa", "Honeos": "Kivuis", "Vulune": "Vuixis",
    "Torkisa": "Rosais", "Gisapra": "Ulbaa", "Osvumar": "Ulvuis", "Sabagi": "Netela", "Satorba": "Vuneis",
    "Lugiul": "Ixlua", "Hoostel": "Ixosa", "Vuroki": "Neulov", "Pragiul": "Givuis", "Nemardor": "Nequia",
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


SYSTEM = "Tools: multiply(a, b), capital(country)."
"""The tools as the prompts describe them (prepare.py puts it in each conversation's system message)."""


class Tools(ToolEnvironment):
    tools = (multiply, capital)

    @classmethod
    def tool_schemas(cls):
        # The chat template would render both JSON schemas (its Qwen2.5-style tool section, about 200 tokens);
        # a 2-layer model 64 wide does not learn to copy across that much context in a few CPU minutes, so the
        # prompts name the tools in one line (SYSTEM) and the schemas are not rendered. A real model keeps them.
        return None

    def reward(self, messages):  # the finished conversation: its last message is the model's answer
        return float(messages[-1]["content"].strip() == str(self.row["answer"]))
