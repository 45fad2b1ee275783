"""WebShop: shopping by search and click, the paper's fourth and only natural-language environment (RAGEN
section 3.1): read an instruction, search a catalogue, open products, pick options, buy. A plain-Python text
mode of princeton-nlp/WebShop (Yao et al. 2022; `web_agent_site/engine/engine.py`, `goal.py`, `normalize.py`,
`envs/web_agent_text_env.py`): BM25 search, reward at [Buy Now] as goal.py's get_reward, success = (r == 1).

    env = WebShopEnv(**overrides); env.reset(seed) -> obs; env.step("click[Buy Now]") -> (obs, r, done, info)
    python extras/webshop.py --write-catalogue DIR | --play SEED    # the generated files; an expert episode

`env.actions`: the two action forms; `env.available_actions()`: the current page's concrete ones. info:
success, action_is_valid, action_is_effective, webshop_reward, page (on a buy: r_type, r_att, r_option,
r_price, asin). Data: the original files (`data_dir=DIR`, `--webshop-data DIR`), by default a small catalogue
generated in their schema. Split (RAGEN's `ragen/env/webshop/env.py`): goals shuffled as WebShop, permuted as
RAGEN, the first H (500; 256 below 1000 goals) held out: a seed in EVAL_SEEDS gets perm[seed % H], any other
perm[H + seed % (n - H)]. Budget: RAGEN_BUDGET. Deviations from WebShop / RAGEN: docs/faithfulness.md.
"""
from __future__ import annotations

import copy
import difflib
import functools
import itertools
import json
import math
import numbers
import os
import random
import re
import sys
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------- constants

EVAL_SEEDS = range(123, 379)          # the paper's 256 fixed eval prompts (section 3.3)
# RAGEN's WebShop config (config/_6_webshop.yaml agent_proxy, config/envs.yaml max_actions_per_traj);
# no env enforces it by itself: the rollout's budget does
RAGEN_BUDGET = {"max_turns": 9, "max_actions_per_turn": 1, "max_actions": 9}
PRICE_RANGE = [10.0 * i for i in range(1, 100)]   # WebShop goal.py: candidate price bounds
SEARCH_RETURN_N = 50                  # WebShop engine: results kept per search
PRODUCT_WINDOW = 10                   # WebShop engine: products per results page
SUBPAGE_WORDS = 60                    # cut for long real descriptions/features/reviews
DEFAULT_NUM_PRODUCTS = 300            # generated catalogue size
GOALS_PER_PRODUCT = 3                 # human-style instructions generated per product
BM25_K1, BM25_B = 0.9, 0.4            # Anserini/pyserini BM25 defaults used by WebShop's Lucene index

BACK, NEXT, PREV, BUY = "Back to Search", "Next >", "< Prev", "Buy Now"
SUBPAGES = ("Description", "Features", "Reviews")

PRODUCT_FILES = ("items_shuffle_1000.json", "items_shuffle.json")
ATTRIBUTE_FILES = ("items_ins_v2_1000.json", "items_ins_v2.json")
HUMAN_FILE, REVIEW_FILE = "items_human_ins.json", "reviews.json"

STOPWORDS = frozenset("""a an and are as at be but by for if in into is it no not of on or such that the their
then there these they this to was will with""".split())
COLORS = ("black", "white", "red", "blue", "green", "grey", "pink", "navy", "brown", "beige", "purple",
          "silver", "yellow", "orange", "gold")
NOT_NOUNS = frozenset(COLORS) | STOPWORDS | frozenset("""classic casual modern lightweight portable premium
smart compact gentle luxury fresh gourmet rustic simple elegant long short slim high low dark deep soft quiet
fast dual free natural sensitive dry whole easy solid new best great good large small big little mini extra
super ultra wireless waterproof durable comfortable cute adjustable portable heavy light warm cool hot cold
organic non i me my your our you we""".split())

QUERY_FILLER = STOPWORDS | frozenset("""i im i'm am looking need want buy find me some color colour size
scent flavor please get would like""".split())

INSTRUCTION = ("You are shopping in a web store. The instruction at the top of the first page says what to "
               "buy. On the search page type search[words]. On other pages click an element shown in "
               "brackets with click[element], e.g. click[Next >], a product id to open it, an option such as "
               "click[red], or click[Buy Now]. Choose the options the instruction names before you buy. "
               "Buying ends the episode with a reward: 1 if type, attributes, options and price limit all "
               "match, less if only some do.")


# ----------------------------------------------------------------------------- text helpers

def search_tokens(text: str) -> list[str]:
    """BM25 tokens: lowercase alphanumerics, stopwords dropped, a trailing plural 's' stripped."""
    out = []
    for t in re.findall(r"[a-z0-9]+", text.lower()):
        if t in STOPWORDS:
            continue
        if len(t) > 3 and t.endswith("s") and not t.endswith("ss"):
            t = t[:-1]
        out.append(t)
    return out


@functools.lru_cache(maxsize=200_000)
def token_set_ratio(a: str, b: str) -> int:
    """thefuzz's token_set_ratio (0..100): compares the shared tokens with each side's full token set, so a
    phrase whose tokens are a subset of the other's scores 100."""
    ta = set(re.sub(r"[^0-9a-z]+", " ", a.lower()).split())
    tb = set(re.sub(r"[^0-9a-z]+", " ", b.lower()).split())
    if not ta or not tb:
        return 0
    common = " ".join(sorted(ta & tb))
    sa = (common + " " + " ".join(sorted(ta - tb))).strip()
    sb = (common + " " + " ".join(sorted(tb - ta))).strip()
    ratio = lambda x, y: difflib.SequenceMatcher(None, x, y).ratio() if x and y else 0.0
    return round(100 * max(ratio(common, sa), ratio(common, sb), ratio(sa, sb)))


def normalize_color(value: str) -> str:
    """WebShop normalize.py: the first known colour found inside the string, else the string itself."""
    for c in COLORS:
        if c in value:
            return c
    return value


def name_nouns(name: str) -> set[str]:
    """Stand-in for spaCy's NOUN/PROPN filter (spaCy is not available here): the name's words minus
    NOT_NOUNS."""
    return {t for t in re.findall(r"[a-z]+", name.lower()) if len(t) > 1 and t not in NOT_NOUNS}


# ----------------------------------------------------------------------------- BM25

@dataclass
class BM25:
    postings: dict[str, list[tuple[int, int]]]   # term -> [(doc index, term frequency)]
    doc_len: list[int]
    avgdl: float
    k1: float = BM25_K1
    b: float = BM25_B


def bm25_index(texts: list[str], k1: float = BM25_K1, b: float = BM25_B) -> BM25:
    postings: dict[str, list[tuple[int, int]]] = {}
    lens = []
    for i, text in enumerate(texts):
        toks = search_tokens(text)
        lens.append(len(toks))
        counts: dict[str, int] = {}
        for t in toks:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            postings.setdefault(t, []).append((i, c))
    return BM25(postings, lens, (sum(lens) / len(lens)) if lens else 0.0, k1, b)


def bm25_scores(index: BM25, query: str) -> dict[int, float]:
    """Okapi BM25 with Lucene's idf log(1 + (N - df + .5) / (df + .5)); every query token counts (as the
    SHOULD clauses of a Lucene query do), so a repeated query word weighs twice."""
    n = len(index.doc_len)
    scores: dict[int, float] = {}
    for t in search_tokens(query):
        post = index.postings.get(t)
        if not post:
            continue
        idf = math.log(1.0 + (n - len(post) + 0.5) / (len(post) + 0.5))
        for d, tf in post:
            norm = index.k1 * (1.0 - index.b + index.b * index.doc_len[d] / index.avgdl)
            scores[d] = scores.get(d, 0.0) + idf * tf * (index.k1 + 1.0) / (tf + norm)
    return scores


def bm25_search(index: BM25, query: str, k: int) -> list[int]:
    """The top-k documents with a positive score, best first, ties by catalogue order."""
    scores = bm25_scores(index, query)
    return sorted(scores, key=lambda d: (-scores[d], d))[:k]


# ------------------------------------------------------------------------ reward (WebShop goal.py get_reward)

def type_reward(product: dict, goal: dict) -> dict:
    """goal.py get_type_reward: same query, >= 2 shared category levels, or > 0.2 of the goal name's nouns."""
    query_match = product["query"] == goal["query"]
    pc = {x.strip() for x in product["product_category"].split("›")}
    gc = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(pc & gc) >= 2
    want, got = name_nouns(goal["name"]), name_nouns(product["name"])
    title_score = len(want & got) / len(want) if want else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def _product_text(product: dict) -> tuple[str, str, str]:
    return (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(),
            product["Description"].lower())


def attribute_matches(product: dict, goal_attrs: list[str]) -> int:
    """goal.py get_attribute_reward: fuzzy match (> 85) with the product's attributes, else a substring of
    its title, features or description."""
    title, bullets, desc = _product_text(product)
    n = 0
    for g in goal_attrs:
        if any(token_set_ratio(p, g) > 85 for p in product["Attributes"]):
            n += 1
        elif g in title or g in bullets or g in desc:
            n += 1
    return n


def option_match(product: dict, name: str, value: str, goal_options: list[str]) -> bool:
    """goal.py get_option_reward, for one bought option: size exactly, others fuzzily, else the value
    appears in the product's text. `goal_options` are already colour-normalised."""
    v = normalize_color(value)
    if name.lower() == "size":
        if v in goal_options:
            return True
    elif any(token_set_ratio(g, v) > 85 for g in goal_options):
        return True
    title, bullets, desc = _product_text(product)
    return v in title or v in bullets or v in desc


def webshop_reward(product: dict, goal: dict, price: float, options: dict) -> tuple[float, dict]:
    """-> (reward in [0, 1], parts). options: {option name: chosen value}."""
    goal_opts = goal["goal_options"]
    goal_opts = list(goal_opts.values()) if isinstance(goal_opts, dict) else list(goal_opts)
    norm_goal = [normalize_color(o) for o in goal_opts]
    t = type_reward(product, goal)
    n_att = attribute_matches(product, goal["attributes"])
    n_opt = sum(option_match(product, k, v, norm_goal) for k, v in options.items())
    # the paper's share of goal options met (WebShop's count per bought option can exceed it: reward > 1)
    n_opt = min(n_opt, len(goal_opts))
    r_price = price <= goal["price_upper"]
    denom = len(goal["attributes"]) + len(goal_opts) + 1
    reward = t["r_type"] * (n_att + n_opt + int(r_price)) / denom
    parts = {"r_type": t["r_type"], "r_att": n_att / max(1, len(goal["attributes"])),
             "r_option": (n_opt / len(goal_opts)) if goal_opts else None, "r_price": bool(r_price)}
    return reward, parts


# ----------------------------------------------------------------------------- the generated catalogue

# (category, group, noun, article, attribute pool, option groups, price range). Every word here ends up in
# the policy's vocabulary, so the lists stay short; tests/test_webshop.py's catalogue_problems() keeps the
# reward honest.
_FASHION_COLORS = ["black", "white", "red", "blue", "green", "grey", "pink", "navy"]
_CLOTHES = ["small", "medium", "large", "x-large"]
_PACKS = ["pack of 2", "pack of 4", "pack of 6"]
_OUNCES = ["2 ounce", "4 ounce", "8 ounce"]
_SCENTS = ["lavender", "vanilla", "rose", "mint", "citrus", "coconut"]
_HOME_COLORS = ["black", "white", "grey", "brown", "beige"]
_TYPES = [
    ("fashion", "clothing", "shirt", "a",
     ["long sleeve", "short sleeve", "machine wash", "button down", "slim fit", "wrinkle free"],
     {"color": _FASHION_COLORS, "size": _CLOTHES}, (10, 45)),
    ("fashion", "clothing", "jacket", "a",
     ["water resistant", "machine wash", "zip pocket", "hooded collar", "slim fit", "fleece lining"],
     {"color": _FASHION_COLORS, "size": _CLOTHES}, (30, 95)),
    ("fashion", "clothing", "dress", "a",
     ["short sleeve", "long sleeve", "machine wash", "floral print", "v neck", "high waist"],
     {"color": _FASHION_COLORS, "size": _CLOTHES}, (20, 60)),
    ("fashion", "shoes", "sneakers", "some",
     ["rubber sole", "lace up", "arch support", "memory foam", "non slip", "breathable mesh"],
     {"color": _FASHION_COLORS, "size": ["7", "8", "9", "10", "11"]}, (35, 110)),
    ("electronics", "audio", "headphones", "some",
     ["wireless bluetooth", "noise cancelling", "long battery life", "built in microphone", "over ear",
      "foldable design"], {"color": ["black", "white", "silver", "grey"]}, (20, 150)),
    ("electronics", "audio", "speaker", "a",
     ["wireless bluetooth", "water resistant", "long battery life", "deep bass", "built in microphone",
      "usb c"], {"color": ["black", "white", "silver", "grey", "red"]}, (15, 90)),
    ("electronics", "accessories", "charger", "a",
     ["fast charging", "usb c", "dual port", "overheat protection", "foldable design", "travel friendly"],
     {"color": ["black", "white", "silver"]}, (8, 35)),
    ("electronics", "accessories", "keyboard", "a",
     ["wireless bluetooth", "backlit keys", "quiet typing", "usb c", "ergonomic design",
      "long battery life"], {"color": ["black", "white", "silver", "pink"]}, (20, 80)),
    ("beauty", "hair care", "shampoo", "some",
     ["sulfate free", "paraben free", "plant based", "dry hair", "cruelty free", "daily use"],
     {"scent": _SCENTS, "size": _OUNCES}, (6, 25)),
    ("beauty", "skin care", "lotion", "some",
     ["dry skin", "sensitive skin", "paraben free", "plant based", "non greasy", "long lasting"],
     {"scent": _SCENTS, "size": _OUNCES}, (6, 30)),
    ("beauty", "makeup", "lipstick", "a",
     ["long lasting", "cruelty free", "matte finish", "plant based", "high pigment",
      "paraben free"], {"color": ["red", "pink", "brown", "purple"]}, (5, 20)),
    ("beauty", "fragrance", "perfume", "a",
     ["long lasting", "cruelty free", "travel size", "plant based", "gift box", "alcohol free"],
     {"scent": _SCENTS, "size": _OUNCES}, (20, 90)),
    ("food", "beverages", "coffee", "some",
     ["usda organic", "non gmo", "low acid", "whole bean", "fair trade", "dark roast"],
     {"flavor": ["original", "vanilla", "caramel", "hazelnut"], "size": _PACKS}, (8, 30)),
    ("food", "beverages", "tea", "some",
     ["usda organic", "caffeine free", "non gmo", "fair trade", "individually wrapped", "loose leaf"],
     {"flavor": ["original", "mint", "lemon", "honey"], "size": _PACKS}, (5, 20)),
    ("food", "snacks", "cookies", "some",
     ["gluten free", "sugar free", "individually wrapped", "non gmo", "high protein", "low calorie"],
     {"flavor": ["chocolate", "vanilla", "caramel", "honey"], "size": _PACKS}, (4, 16)),
    ("food", "snacks", "granola", "some",
     ["gluten free", "high protein", "low sugar", "non gmo", "whole grain", "low calorie"],
     {"flavor": ["honey", "chocolate", "original", "almond"], "size": _PACKS}, (5, 18)),
    ("garden", "furniture", "chair", "a",
     ["solid wood", "easy assembly", "living room", "metal frame", "high back", "padded seat"],
     {"color": _HOME_COLORS, "size": ["small", "medium", "large"]}, (40, 200)),
    ("garden", "furniture", "table", "a",
     ["solid wood", "easy assembly", "living room", "metal frame", "dining room", "storage shelf"],
     {"color": _HOME_COLORS, "size": ["small", "medium", "large"]}, (50, 300)),
    ("garden", "lighting", "lamp", "a",
     ["living room", "touch control", "dimmable light", "usb port", "energy saving", "metal frame"],
     {"color": _HOME_COLORS}, (15, 80)),
    ("garden", "decor", "rug", "a",
     ["non slip", "machine wash", "living room", "stain resistant", "low pile", "soft touch"],
     {"color": _HOME_COLORS, "size": ["small", "medium", "large"]}, (25, 150)),
]
_STYLES = {"fashion": ["classic", "casual", "modern", "lightweight"],
           "electronics": ["portable", "premium", "smart", "compact"],
           "beauty": ["gentle", "premium", "luxury", "fresh"],
           "food": ["premium", "gourmet", "classic", "fresh"],
           "garden": ["modern", "rustic", "simple", "elegant"]}
_DESCRIPTIONS = ["a {style} {noun} with {attrs}.", "this {noun} comes with {attrs}.",
                 "our {style} {noun} features {attrs}."]
_REVIEWS = [(5, "great {noun}, works as described"), (5, "love it, would buy again"),
            (4, "good value for the price"), (3, "it is okay for the price"), (2, "not what i expected")]
_ASKS = ["i am looking for {art} {noun} with {attrs}", "i need {art} {noun} with {attrs}",
         "find me {art} {noun} with {attrs}", "i want to buy {art} {noun} with {attrs}"]
_OPTION_PHRASES = {"color": "in {v} color", "size": "in size {v}", "scent": "with {v} scent",
                   "flavor": "in {v} flavor"}


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def generate_catalogue(num_products: int = DEFAULT_NUM_PRODUCTS, seed: int = 0):
    """-> (products, attributes, human_instructions, reviews), raw records in the original WebShop schema
    (items_shuffle.json, items_ins_v2.json, items_human_ins.json, reviews.json). Deterministic in seed."""
    rng = random.Random(seed)
    products, attributes, human, reviews = [], {}, {}, []
    for i in range(num_products):
        cat, group, noun, art, pool, opt_groups, (lo, hi) = _TYPES[i % len(_TYPES)]
        asin = f"B{i:03d}"
        style = rng.choice(_STYLES[cat])
        attrs = rng.sample(pool, rng.choice([3, 4]))
        options = {}
        for name, values in opt_groups.items():
            keep = sorted(rng.sample(range(len(values)), rng.randint(2, len(values))))
            options[name] = [values[j] for j in keep]
        price = f"{rng.randint(lo, hi - 1)}{rng.choice(['.99', '.49', '.00'])}"
        products.append({
            "asin": asin, "category": cat, "query": noun, "name": f"{style} {attrs[0]} {noun}",
            "product_category": f"{cat} › {group} › {noun}",
            "full_description": rng.choice(_DESCRIPTIONS).format(style=style, noun=noun, attrs=_join(attrs)),
            "small_description": list(attrs), "pricing": f"${price}", "images": [""],
            "customization_options": {k: [{"value": v, "image": None} for v in vs]
                                      for k, vs in options.items()},
        })
        revs = [{"score": s, "body": b.format(noun=noun)} for s, b in rng.sample(_REVIEWS, 2)]
        reviews.append({"asin": asin, "reviews": revs,
                        "average_rating": sum(r["score"] for r in revs) / len(revs)})
        syn_attrs = rng.sample(attrs, 2)
        attributes[asin] = {"attributes": list(attrs),
                            "instruction": f"i need {art} {noun} with {_join(syn_attrs)}",
                            "instruction_attributes": syn_attrs}
        human[asin] = []
        for _ in range(GOALS_PER_PRODUCT):
            want = rng.sample(attrs, rng.choice([1, 2, 2, 3]))
            picks = {k: rng.choice(vs) for k, vs in options.items()}
            text = rng.choice(_ASKS).format(art=art, noun=noun, attrs=_join(want))
            if picks:
                text += ", " + " and ".join(_OPTION_PHRASES[k].format(v=v) for k, v in picks.items())
            human[asin].append({"asin": asin, "instruction": text, "instruction_attributes": want,
                                "instruction_options": list(picks.values())})
    return products, attributes, human, reviews


def write_catalogue(out_dir: str, num_products: int = DEFAULT_NUM_PRODUCTS, seed: int = 0) -> list[str]:
    """Write the generated catalogue as the original files; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    data = generate_catalogue(num_products, seed)
    names = ("items_shuffle.json", "items_ins_v2.json", HUMAN_FILE, REVIEW_FILE)
    paths = []
    for name, obj in zip(names, data):
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- loader (engine.py load_products)

def _first_existing(data_dir: str, names: tuple[str, ...]) -> str:
    for n in names:
        p = os.path.join(data_dir, n)
        if os.path.exists(p):
            return p
    raise ValueError(f"webshop data_dir {data_dir!r} has none of {', '.join(names)}")


def read_files(data_dir: str):
    """-> (products, attributes, human_instructions, reviews) as stored in the original JSON files."""
    if not os.path.isdir(data_dir):
        raise ValueError(f"webshop data_dir {data_dir!r} is not a directory")
    paths = [_first_existing(data_dir, names) for names in (PRODUCT_FILES, ATTRIBUTE_FILES, (HUMAN_FILE,))]
    review = os.path.join(data_dir, REVIEW_FILE)
    loaded = [_read_json(p) for p in paths] + [_read_json(review) if os.path.exists(review) else []]
    return tuple(loaded)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"webshop data file {path}: cannot be read as JSON ({e})") from None


def _parse_pricing(pricing) -> tuple[list[float], str]:
    if not pricing:
        return [100.0], "$100.0"
    nums = []
    for piece in str(pricing).split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece).strip(".")
        if digits:
            nums.append(float(digits))
    if not nums:
        return [100.0], "$100.0"
    if len(nums) == 1:
        return nums, f"${nums[0]}"
    return nums[:2], f"${nums[0]} to ${nums[1]}"


def clean_products(raw: list[dict], attributes: dict, human: dict, reviews: list[dict],
                   num_products: int | None = None, human_goals: bool = True) -> list[dict]:
    """The fields the engine uses, from the original records (engine.py load_products)."""
    ratings = {r["asin"]: r.get("average_rating", "N.A.") for r in reviews}
    all_reviews = {r["asin"]: r.get("reviews", []) for r in reviews}
    if num_products is not None:
        raw = raw[:num_products]
    seen, out = set(), []
    for p in raw:
        asin = str(p.get("asin", "nan"))
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        pricing, price_tag = _parse_pricing(p.get("pricing"))
        options = {}
        for oname, contents in (p.get("customization_options") or {}).items():
            if contents is None:
                continue
            options[oname.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
        bullets = p.get("small_description") or []
        revs = [{"score": r.get("score", r.get("stars")), "body": r.get("body", r.get("review", ""))}
                for r in all_reviews.get(asin, [])]
        rating = ratings.get(asin, "N.A.")
        item = {
            "asin": asin, "category": p.get("category", ""), "query": p.get("query", "").lower().strip(),
            "product_category": p.get("product_category", ""), "name": p.get("name", ""),
            "Title": p.get("name", ""), "Description": p.get("full_description") or "",
            "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
            "pricing": pricing, "Price": price_tag, "options": options,
            "Attributes": attributes.get(asin, {}).get("attributes") or ["DUMMY_ATTR"],
            "Rating": round(rating, 1) if isinstance(rating, (int, float)) else rating, "Reviews": revs,
        }
        if human_goals:
            if asin in human:
                item["instructions"] = human[asin]
        else:
            item["instruction_text"] = attributes.get(asin, {}).get("instruction")
            item["instruction_attributes"] = attributes.get(asin, {}).get("instruction_attributes")
        out.append(item)
    return out


def product_prices(products: list[dict]) -> dict[str, float]:
    """engine.py generate_product_prices, with a price range drawn from an RNG seeded by the asin."""
    out = {}
    for p in products:
        pr = p["pricing"]
        out[p["asin"]] = pr[0] if len(pr) == 1 else random.Random(f"price:{p['asin']}").uniform(*pr[:2])
    return out


def _price_bound(rng: random.Random, price: float) -> tuple[float, str]:
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) >= 2:
        _, upper = sorted(rng.sample(candidates, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return 1000000.0, ""


def build_goals(products: list[dict], prices: dict[str, float], human_goals: bool = True) -> list[dict]:
    """goal.py get_human_goals / get_synthetic_goals, then WebShop's fixed shuffle (seed 233)."""
    rng = random.Random(0)
    goals = []
    for p in products:
        base = {"asin": p["asin"], "category": p["category"], "query": p["query"], "name": p["name"],
                "product_category": p["product_category"]}
        if human_goals:
            for ins in p.get("instructions", []):
                attrs = ins.get("instruction_attributes") or []
                if not attrs:
                    continue
                upper, price_text = _price_bound(rng, prices[p["asin"]])
                goals.append({**base, "instruction_text": ins["instruction"].strip(".") + price_text,
                              "attributes": list(attrs), "price_upper": upper,
                              "goal_options": list(ins.get("instruction_options") or [])})
        elif p.get("instruction_text") and p.get("instruction_attributes"):
            upper, price_text = _price_bound(rng, prices[p["asin"]])
            names = sorted(p["options"])
            for combo in itertools.product(*(p["options"][n] for n in names)):
                opts = dict(zip(names, combo))
                opt_text = ", and ".join(f"{k}: {v}" for k, v in opts.items())
                opt_text = f" with {opt_text}" if opt_text else ""
                goals.append({**base, "name": p["Title"],
                              "instruction_text": f"{p['instruction_text']}{opt_text}{price_text}",
                              "attributes": list(p["instruction_attributes"]), "price_upper": upper,
                              "goal_options": opts})
    random.Random(233).shuffle(goals)
    return goals


# ----------------------------------------------------------------------------- the shop (shared, read-only)

def heldout_size(n_goals: int) -> int:
    return 500 if n_goals >= 1000 else len(EVAL_SEEDS)


def goal_index(seed: int, perm: list[int]) -> int:
    """Seed -> goal (module docstring): eval seeds draw from the held-out head of the permutation only."""
    n, h = len(perm), heldout_size(len(perm))
    return perm[seed % h] if seed in EVAL_SEEDS else perm[h + seed % (n - h)]


@dataclass
class Shop:
    products: list[dict]
    by_asin: dict[str, dict]
    prices: dict[str, float]
    goals: list[dict]
    perm: list[int]                       # RAGEN's fixed goal permutation (random.Random(42))
    index: BM25
    words: list[str] = field(default_factory=list)   # catalogue words for random searches


def make_shop(products: list[dict], human_goals: bool = True) -> Shop:
    prices = product_prices(products)
    goals = build_goals(products, prices, human_goals)
    if len(goals) <= heldout_size(len(goals)):
        raise ValueError(f"webshop catalogue gives {len(goals)} goals; the train/eval split needs more than "
                         f"{heldout_size(len(goals))} (raise num_products)")
    perm = list(range(len(goals)))
    random.Random(42).shuffle(perm)
    docs = []
    for p in products:
        opts = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())
        docs.append(" ".join([p["Title"], p["Description"], " ".join(p["BulletPoints"]),
                              " ".join(p["Attributes"]), opts]))
    words = sorted({w for p in products
                    for w in re.findall(r"[a-z]+", (p["Title"] + " " + " ".join(p["BulletPoints"])).lower())
                    if w not in STOPWORDS and len(w) > 1})
    return Shop(products, {p["asin"]: p for p in products}, prices, goals, perm, bm25_index(docs), words)


_SHOPS: dict[tuple, Shop] = {}


def get_shop(data_dir: str | None = None, num_products: int | None = None, catalogue_seed: int = 0,
             human_goals: bool = True) -> Shop:
    """Built once per process and configuration, shared read-only by every env."""
    key = (os.path.abspath(data_dir) if data_dir else None, num_products, catalogue_seed, human_goals)
    if key not in _SHOPS:
        if data_dir is None:
            raw = generate_catalogue(num_products or DEFAULT_NUM_PRODUCTS, catalogue_seed)
            products = clean_products(*raw, human_goals=human_goals)
        else:
            products = clean_products(*read_files(data_dir), num_products=num_products,
                                      human_goals=human_goals)
        _SHOPS[key] = make_shop(products, human_goals)
    return _SHOPS[key]


# ----------------------------------------------------------------------------- the environment

_DEFAULTS = {"data_dir": None, "num_products": None, "catalogue_seed": 0, "human_goals": True,
             "page_size": PRODUCT_WINDOW, "max_results": SEARCH_RETURN_N, "repeat_instruction": True}
_ACTION_RE = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.IGNORECASE | re.DOTALL)


def parse_action(action) -> tuple[str, str] | None:
    """'Click[ Buy  Now ]' -> ('click', 'buy now'); None when it is not of either form."""
    if not isinstance(action, str):
        return None
    m = _ACTION_RE.fullmatch(action)
    if m is None:
        return None
    return m.group(1).lower(), " ".join(m.group(2).lower().split())


def _check_overrides(overrides: dict) -> dict:
    cfg = dict(_DEFAULTS)
    for key, value in overrides.items():
        if key not in _DEFAULTS:
            raise ValueError(f"unknown webshop override {key!r}; allowed: {', '.join(_DEFAULTS)}")
        cfg[key] = value
    is_int = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if cfg["data_dir"] is not None and not isinstance(cfg["data_dir"], (str, os.PathLike)):
        raise ValueError(f"webshop data_dir={cfg['data_dir']!r}: allowed None or a directory path")
    if cfg["data_dir"] is not None:
        cfg["data_dir"] = os.fspath(cfg["data_dir"])
        if not os.path.isdir(cfg["data_dir"]):
            raise ValueError(f"webshop data_dir={cfg['data_dir']!r}: not a directory")
    n = cfg["num_products"]
    if n is not None and not (is_int(n) and (1 <= n <= 999 if cfg["data_dir"] is None else n >= 1)):
        limit = "1..999 for the generated catalogue" if cfg["data_dir"] is None else ">= 1"
        raise ValueError(f"webshop num_products={n!r}: allowed None or an integer {limit}")
    for key, low in (("catalogue_seed", None), ("page_size", 1), ("max_results", 1)):
        v = cfg[key]
        if not is_int(v) or (low is not None and v < low):
            allowed = "an integer" if low is None else f"an integer >= {low}"
            raise ValueError(f"webshop {key}={v!r}: allowed {allowed}")
    for key in ("human_goals", "repeat_instruction"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"webshop {key}={cfg[key]!r}: allowed True or False")
    return cfg


def _cut(text: str, n: int = SUBPAGE_WORDS) -> str:
    words = text.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


class WebShopEnv:
    """One shopping episode per reset(seed); see the module docstring for pages, reward and split."""

    name = "webshop"
    actions = ["search[<words>]", "click[<element>]"]
    instruction = INSTRUCTION

    def __init__(self, **overrides):
        self.cfg = _check_overrides(overrides)
        self._shop = get_shop(self.cfg["data_dir"], self.cfg["num_products"], self.cfg["catalogue_seed"],
                              self.cfg["human_goals"])
        self.done = False
        self._page = None                 # None until reset: "search" | "results" | "item" | "sub" | "done"

    def __deepcopy__(self, memo):
        """Copies the episode state; the shop (catalogue, index, goals) is shared, never copied."""
        memo[id(self._shop)] = self._shop
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        return new

    # ------------------------------------------------------------------ episode
    def reset(self, seed: int, sample: int = 0) -> str:  # deterministic site: `sample` changes nothing
        if not isinstance(sample, numbers.Integral) or isinstance(sample, bool) or sample < 0:
            raise ValueError(f"webshop reset sample={sample!r}: allowed an integer >= 0")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"webshop reset seed={seed!r}: allowed an integer")
        self.seed = int(seed)
        self.goal_id = goal_index(self.seed, self._shop.perm)
        self.goal = self._shop.goals[self.goal_id]
        self.done = False
        self._steps = 0
        self._page, self._keywords, self._results, self._page_no = "search", "", [], 1
        self._asin, self._options, self._sub = None, {}, None
        self._bought = None
        self._expert_cache = {}
        self._render()
        return self._obs

    def render(self) -> str:
        if self._page is None:
            raise RuntimeError("webshop: call reset(seed) before render()")
        return self._obs

    def step(self, action: str):
        if self._page is None:
            raise RuntimeError("webshop: call reset(seed) before step()")
        if self.done:
            raise RuntimeError("webshop: the episode is done (the product was bought); call reset(seed)")
        old = self._obs
        reward, extra = 0.0, {}
        parsed = parse_action(action)
        valid = False
        if parsed is not None:
            verb, arg = parsed
            if verb == "search" and self._page == "search" and arg:
                valid = True
                self._keywords, self._results = arg, bm25_search(self._shop.index, arg,
                                                                  self.cfg["max_results"])
                self._page, self._page_no, self._asin, self._options = "results", 1, None, {}
            elif verb == "click" and arg in self._click:
                valid = True
                reward, extra = self._click_element(self._click[arg])
        if valid:
            self._steps += 1
            self._render()
        info = {"success": reward >= 1.0 - 1e-9, "action_is_valid": valid,
                "action_is_effective": self._obs != old, "webshop_reward": reward, "page": self._page,
                **extra}
        return self._obs, reward, self.done, info

    def _click_element(self, el: tuple) -> tuple[float, dict]:
        kind = el[0]
        if kind == "back":
            self._page, self._keywords, self._results, self._asin, self._options = "search", "", [], None, {}
        elif kind in ("next", "prev") and self._page == "results":
            self._page_no += 1 if kind == "next" else -1
        elif kind == "prev" and self._page == "item":
            self._page, self._asin, self._options = "results", None, {}
        elif kind == "prev" and self._page == "sub":
            self._page, self._sub = "item", None
        elif kind == "product":
            self._page, self._asin, self._options = "item", el[1], {}
        elif kind == "option":
            self._options[el[1]] = el[2]
        elif kind == "sub":
            self._page, self._sub = "sub", el[1]
        elif kind == "buy":
            product = self._shop.by_asin[self._asin]
            reward, parts = webshop_reward(product, self.goal, self._shop.prices[self._asin], self._options)
            self._bought = (self._asin, dict(self._options), reward)
            self._page, self.done = "done", True
            return reward, {**parts, "asin": self._asin}
        return 0.0, {}

    # ------------------------------------------------------------------ pages
    def _render(self):
        """Sets self._obs (the page text) and self._click (lowercase label -> element)."""
        lines = []
        if self.cfg["repeat_instruction"] or self._page == "search":
            lines.append(f"Instruction: {self.goal['instruction_text']}")
        click: dict[str, tuple] = {}
        labels: list[str] = []

        def button(label: str, element: tuple) -> str:
            key = " ".join(label.lower().split())
            # the first element with a label keeps it (WebShop: the last one read)
            if key not in click:
                click[key] = element
                labels.append(label)
            return f"[{label}]"

        page = self._page
        if page == "search":
            lines.append("Search page: type search[words].")
        elif page == "results":
            n, size = len(self._results), self.cfg["page_size"]
            pages = max(1, math.ceil(n / size))
            lines.append(f"Results for {self._keywords}: page {self._page_no} of {pages} ({n} total)")
            nav = [button(BACK, ("back",))]
            if self._page_no > 1:
                nav.append(button(PREV, ("prev",)))
            if self._page_no * size < n:
                nav.append(button(NEXT, ("next",)))
            lines.append(" ".join(nav))
            for d in self._results[(self._page_no - 1) * size:self._page_no * size]:
                p = self._shop.products[d]
                lines.append(f"{button(p['asin'], ('product', p['asin']))} {p['Title']} {p['Price']}")
        elif page in ("item", "sub"):
            p = self._shop.by_asin[self._asin]
            lines.append(f"{button(BACK, ('back',))} {button(PREV, ('prev',))}")
            if page == "item":
                lines.append(p["Title"])
                lines.append(f"Price: {p['Price']}, Rating: {p['Rating']}")
                fixed = {BUY.lower()} | {s.lower() for s in SUBPAGES}
                for oname, values in p["options"].items():
                    shown = []
                    for v in values:           # a value whose label is taken stays plain text
                        key = " ".join(v.lower().split())
                        taken = not key or key in fixed or key in click
                        shown.append(v if taken else button(v, ("option", oname, v)))
                    lines.append(f"{oname}: {' '.join(shown)}")
                if self._options:
                    lines.append("Selected: " + ", ".join(f"{k} {v}" for k, v in self._options.items()))
                lines.append(" ".join([button(s, ("sub", s)) for s in SUBPAGES] + [button(BUY, ("buy",))]))
            elif self._sub == "Description":
                lines.append(f"Description: {_cut(p['Description'])}")
            elif self._sub == "Features":
                lines.append(f"Features: {_cut('; '.join(p['BulletPoints']))}")
            else:
                revs = " ".join(f"({r['score']}) {r['body']}" for r in p["Reviews"]) or "none"
                lines.append(f"Reviews: {_cut(revs)}")
        else:  # done
            asin, opts, r = self._bought
            chosen = ", ".join(f"{k} {v}" for k, v in opts.items()) or "no options"
            lines.append(f"You bought {asin} ({chosen}). Score: {r:.2f}")
        self._obs, self._click, self._labels = "\n".join(lines), click, labels

    def available_actions(self) -> list[str]:
        """Every valid action of the current page; on the search page ten searches of 1-4 random catalogue
        words (search accepts any words), drawn from an RNG seeded by (seed, step) so that they are
        reproducible."""
        if self._page is None or self.done:
            return []
        if self._page == "search":
            rng = random.Random(f"{self.seed}:{self._steps}")
            words = self._shop.words
            return [f"search[{' '.join(rng.choice(words) for _ in range(rng.randint(1, 4)))}]"
                    for _ in range(10)]
        return [f"click[{label}]" for label in self._labels]

    # ------------------------------------------------------------------ expert
    def expert_query(self) -> str:
        """The goal's instruction without its price clause and filler words."""
        text = re.sub(r",? and price lower than [\d.]+ dollars$", "", self.goal["instruction_text"])
        words = re.sub(r"[^a-z0-9 '\-]+", " ", text.lower()).split()
        return " ".join(w for w in words if w not in QUERY_FILLER) or " ".join(words)

    def _expert_picks(self, product: dict) -> dict:
        """Per option group, the first value that counts as a goal option (nothing if none does)."""
        goal = self.goal["goal_options"]
        norm = [normalize_color(o) for o in (goal.values() if isinstance(goal, dict) else goal)]
        picks = {}
        for oname, values in product["options"].items():
            for v in values:
                if option_match(product, oname, v, norm):
                    picks[oname] = v
                    break
        return picks

    def _expert_target(self) -> tuple[int, str, dict] | None:
        """(rank, asin, options) of the result with the highest reward; None when there are no results."""
        if self._keywords not in self._expert_cache:
            best = None
            for rank, d in enumerate(self._results):
                p = self._shop.products[d]
                picks = self._expert_picks(p)
                r, _ = webshop_reward(p, self.goal, self._shop.prices[p["asin"]], picks)
                if best is None or r > best[0] + 1e-12:
                    best = (r, rank, p["asin"], picks)
            self._expert_cache[self._keywords] = None if best is None else best[1:]
        return self._expert_cache[self._keywords]

    def expert_action(self) -> str:
        if self._page is None or self.done:
            raise RuntimeError("webshop: no expert action (call reset(seed); the episode may be done)")
        if self._page == "search":
            return f"search[{self.expert_query()}]"
        if self._page == "sub":
            return f"click[{PREV}]"
        target = self._expert_target()
        if target is None:
            return f"click[{BACK}]"
        rank, asin, picks = target
        if self._page == "results":
            want = rank // self.cfg["page_size"] + 1
            if want > self._page_no:
                return f"click[{NEXT}]"
            if want < self._page_no:
                return f"click[{PREV}]"
            return f"click[{asin}]"
        if self._asin != asin:
            return f"click[{PREV}]"
        for oname, v in picks.items():
            el = self._click.get(" ".join(v.lower().split()))
            if self._options.get(oname) != v and el == ("option", oname, v):
                return f"click[{v}]"
        return f"click[{BUY}]"


# ----------------------------------------------------------------------------- CLI

def main(argv=None):
    from engine import cli
    ap = cli.Parser(description="WebShop environment: write the generated catalogue as the original "
                                "files, or print the expert's episode for one goal. (Baselines: python "
                                "eval.py --env webshop --policy expert|random --max-turns 9 "
                                "--max-actions-per-turn 1 --max-actions 9)")
    ap.add_argument("--write-catalogue", metavar="DIR",
                    help="write the generated catalogue's JSON files into DIR")
    ap.add_argument("--play", type=int, metavar="SEED", help="print the expert's episode for one seed (>= 0)")
    ap.add_argument("--data-dir", default=None,
                    help="original WebShop files (default: the generated catalogue)")
    ap.add_argument("--num-products", type=int, default=None, help="products to load (generated: 1..999)")
    ap.add_argument("--max-actions", type=int, default=RAGEN_BUDGET["max_actions"],
                    help=f"actions of --play (RAGEN: {RAGEN_BUDGET['max_actions']})")
    args = ap.parse_args(argv)
    if argv == [] or (argv is None and len(sys.argv) == 1):  # no flags at all: what the script can do
        ap.print_help()
        return
    try:
        cli.check([(args.play is None or args.play >= 0, f"--play {args.play}: must be >= 0"),
                   (args.max_actions >= 1, f"--max-actions {args.max_actions}: must be >= 1"),
                   (args.num_products is None or args.num_products >= 1,
                    f"--num-products {args.num_products}: must be >= 1"),
                   (args.write_catalogue is not None or args.play is not None,
                    "nothing to do: give --write-catalogue DIR or --play SEED")])
        if args.write_catalogue is not None:
            names = ("items_shuffle.json", "items_ins_v2.json", HUMAN_FILE, REVIEW_FILE)
            there = [n for n in names if os.path.exists(os.path.join(args.write_catalogue, n))]
            cli.check([(not os.path.exists(args.write_catalogue) or os.path.isdir(args.write_catalogue),
                        f"--write-catalogue {args.write_catalogue}: exists and is not a folder"),
                       (not there, f"--write-catalogue {args.write_catalogue}: {', '.join(there)} already "
                                   f"there; choose another folder (nothing is overwritten)")])
            cli.run_folder(args.write_catalogue, "--write-catalogue", overwrite=False)
        env = (WebShopEnv(data_dir=args.data_dir, num_products=args.num_products) if args.play is not None
               else None)
    except ValueError as e:
        cli.fail(str(e).replace("webshop data_dir", "--data-dir")
                 .replace("webshop num_products=", "--num-products "))
    if args.write_catalogue is not None:
        for path in write_catalogue(args.write_catalogue, args.num_products or DEFAULT_NUM_PRODUCTS):
            print("wrote", path)
    if env is not None:
        print(env.reset(args.play))
        for _ in range(args.max_actions):
            a = env.expert_action()
            obs, r, done, info = env.step(a)
            print(f"\n> {a}  (reward {r:.2f})\n{obs}")
            if done:
                break


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    from engine import cli
    cli.run(main)
