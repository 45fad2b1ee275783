"""Tests for webshop.py: pages and action parsing, BM25, the WebShop reward, the loader, the seed split,
determinism, and the scripted expert.

Run: python -m pytest -q tests/test_webshop.py   (a few seconds on 2 CPU cores)
"""
import copy
import json
import math
import os
import random
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from extras import webshop as ws  # noqa: E402


@pytest.fixture(scope="module")
def env():
    return ws.WebShopEnv()


def open_item(env, seed=123):
    """Reset, search with the expert's query, open the first result; -> its asin."""
    env.reset(seed)
    env.step(env.expert_action())
    first = next(a for a in env.available_actions() if a[len("click["):-1] in env._shop.by_asin)
    env.step(first)
    return first[len("click["):-1]


def assert_invalid(env, action):
    before = env.render()
    obs, r, done, info = env.step(action)
    assert (obs, r, done) == (before, 0.0, False), action
    assert info["action_is_valid"] is False and info["action_is_effective"] is False
    assert info["success"] is False and env.render() == before


# ----------------------------------------------------------------------------- pages and parsing

def test_search_page(env):
    obs = env.reset(123)
    assert obs == env.render()
    assert obs.splitlines()[0] == "Instruction: " + env.goal["instruction_text"]
    assert "search[words]" in obs
    acts = env.available_actions()
    assert len(acts) == 10 and all(a.startswith("search[") and a.endswith("]") for a in acts)
    assert env.name == "webshop" and env.actions == ["search[<words>]", "click[<element>]"]
    for a in ["click[Buy Now]", "click[Back to Search]", "buy", "", "   ", None, 42, "search[]",
              "search[   ]", "search red shirt", "jump[red]", "search[red] extra"]:
        assert_invalid(env, a)


def test_results_page_and_navigation(env):
    env.reset(123)
    obs, r, done, info = env.step("  Search [ Jacket   SHIRT dress sneakers ]  ")   # case and spacing
    assert info["action_is_valid"] and info["action_is_effective"] and r == 0.0 and not done
    lines = obs.splitlines()
    assert lines[1] == "Results for jacket shirt dress sneakers: page 1 of 5 (50 total)"
    assert lines[2] == "[Back to Search] [Next >]"
    items = lines[3:]
    ranked = ws.bm25_search(env._shop.index, "jacket shirt dress sneakers", 50)
    assert len(items) == 10 and len(ranked) == 50
    for line, d in zip(items, ranked):
        p = env._shop.products[d]
        assert line == f"[{p['asin']}] {p['Title']} {p['Price']}"
    assert_invalid(env, "click[< Prev]")                 # no Prev on page 1
    assert_invalid(env, "search[shirt]")                 # no search bar on the results page
    assert_invalid(env, "click[B999]")
    obs2, *_ = env.step("click[next >]")
    assert "page 2 of 5" in obs2 and "[< Prev]" in obs2 and set(obs2.splitlines()[3:]).isdisjoint(items)
    for _ in range(3):
        env.step("CLICK[Next >]")
    assert "page 5 of 5" in env.render() and "[Next >]" not in env.render()
    assert_invalid(env, "click[Next >]")
    obs3, *_ = env.step("click[back to search]")
    assert obs3 == env.reset(123)


def test_item_page_options_and_subpages(env):
    asin = open_item(env)
    p = env._shop.by_asin[asin]
    obs = env.render()
    assert p["Title"] in obs and f"Price: {p['Price']}, Rating: {p['Rating']}" in obs
    assert obs.splitlines()[1] == "[Back to Search] [< Prev]"
    assert obs.splitlines()[-1] == "[Description] [Features] [Reviews] [Buy Now]"
    for oname, values in p["options"].items():
        assert f"{oname}: " + " ".join(f"[{v}]" for v in values) in obs
    oname, values = next(iter(p["options"].items()))
    obs, r, done, info = env.step(f"click[{values[0].upper()}]")
    assert info["action_is_valid"] and info["action_is_effective"] and f"Selected: {oname} {values[0]}" in obs
    obs_again, _, _, info = env.step(f"click[{values[0]}]")   # same option again: valid, page unchanged
    assert info["action_is_valid"] and not info["action_is_effective"] and obs_again == obs
    env.step(f"click[{values[1]}]")
    assert f"Selected: {oname} {values[1]}" in env.render()
    sub, *_ = env.step("click[Features]")
    assert sub.splitlines()[-1] == "Features: " + "; ".join(p["BulletPoints"])
    assert_invalid(env, "click[Buy Now]")                # not on a sub-page
    back, *_ = env.step("click[< Prev]")
    assert back == obs_again.replace(values[0], values[0]).replace(
        f"Selected: {oname} {values[0]}", f"Selected: {oname} {values[1]}")
    desc, *_ = env.step("click[description]")
    assert desc.splitlines()[-1] == "Description: " + p["Description"]
    env.step("click[< prev]")
    rev, *_ = env.step("click[Reviews]")
    assert rev.splitlines()[-1].startswith("Reviews: (")
    env.step("click[< Prev]")
    results, *_ = env.step("click[< Prev]")              # item -> results, options forgotten
    assert results.splitlines()[1].startswith("Results for ")


def test_buy_ends_episode(env):
    open_item(env)
    obs, r, done, info = env.step("click[buy now]")
    assert done and env.done and info["action_is_valid"] and info["page"] == "done"
    assert 0.0 <= r <= 1.0 and info["webshop_reward"] == r and info["success"] == (r == 1.0)
    assert {"r_type", "r_att", "r_option", "r_price", "asin"} <= set(info)
    assert obs.splitlines()[-1].startswith(f"You bought {info['asin']}")
    with pytest.raises(RuntimeError):
        env.step("click[Buy Now]")
    with pytest.raises(RuntimeError):
        env.expert_action()
    assert env.available_actions() == []


def test_before_reset_and_bad_seed():
    e = ws.WebShopEnv()
    with pytest.raises(RuntimeError):
        e.step("search[shirt]")
    with pytest.raises(ValueError):
        e.reset("7")


def test_parse_action():
    assert ws.parse_action("Click[ Buy  Now ]") == ("click", "buy now")
    assert ws.parse_action(" SEARCH [Red Shirt] ") == ("search", "red shirt")
    assert ws.parse_action("click[black | blue]") == ("click", "black | blue")
    assert ws.parse_action("click[a]b]") == ("click", "a]b")
    for bad in ["click", "click[x", "look[x]", "", None, 3, "click[x] || click[y]x"]:
        assert ws.parse_action(bad) is None


def test_every_available_action_is_valid_and_has_no_separator(env):
    rng = random.Random(1)
    for seed in range(20):
        env.reset(seed)
        for _ in range(8):
            acts = env.available_actions()
            assert acts and all("||" not in a for a in acts)
            for a in acts:
                assert copy.deepcopy(env).step(a)[3]["action_is_valid"], a
            if env.step(rng.choice(acts))[2]:
                break


def test_repeat_instruction_off_and_page_size():
    e = ws.WebShopEnv(repeat_instruction=False, page_size=5)
    assert e.reset(123).startswith("Instruction: ")
    obs, *_ = e.step("search[shirt]")
    assert not obs.startswith("Instruction") and len(obs.splitlines()) == 2 + 5


# ----------------------------------------------------------------------------- BM25

MINI = ["red cotton shirt", "blue cotton shirt shirt", "red wool jacket", "green linen towel"]


def reference_bm25(docs, query, k1=0.9, b=0.4):
    """Slow, obvious BM25 over whitespace tokens (the mini catalogue has no stopwords or plurals)."""
    toks = [d.split() for d in docs]
    avgdl = sum(map(len, toks)) / len(toks)
    out = {}
    for i, d in enumerate(toks):
        s = 0.0
        for q in query.split():
            tf, df = d.count(q), sum(q in t for t in toks)
            if tf:
                idf = math.log(1 + (len(toks) - df + 0.5) / (df + 0.5))
                s += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avgdl))
        if s > 0:
            out[i] = s
    return out


def test_bm25_ranking_on_mini_catalogue():
    index = ws.bm25_index(MINI)
    assert ws.bm25_search(index, "shirt", 10) == [1, 0]          # tf 2 beats tf 1
    assert ws.bm25_search(index, "red jacket", 10) == [2, 0]     # both terms beat one
    assert ws.bm25_search(index, "cotton jacket", 10)[0] == 2    # the rare term weighs more
    assert ws.bm25_search(index, "towels", 10) == [3]            # plural 's' stripped
    assert ws.bm25_search(index, "the of", 10) == []             # stopwords only
    assert ws.bm25_search(index, "Red Cotton", 1) == [0]
    for q in ["shirt", "red jacket", "cotton jacket", "green shirt linen", "red red shirt"]:
        got, want = ws.bm25_scores(index, q), reference_bm25(MINI, q)
        assert set(got) == set(want)
        for d in want:
            assert got[d] == pytest.approx(want[d], rel=1e-12)


def test_bm25_ties_break_by_catalogue_order():
    index = ws.bm25_index(["lamp", "lamp", "lamp"])
    assert ws.bm25_search(index, "lamp", 10) == [0, 1, 2]


# ----------------------------------------------------------------------------- reward

def product(**kw):
    p = {"asin": "X1", "query": "shirt", "product_category": "fashion › clothing › shirt",
         "name": "classic long sleeve shirt", "Title": "classic long sleeve shirt",
         "BulletPoints": ["long sleeve", "machine wash"], "Description": "a classic shirt.",
         "Attributes": ["long sleeve", "machine wash"],
         "options": {"color": ["red", "blue"], "size": ["medium", "large"]}}
    p.update(kw)
    return p


GOAL = {"query": "shirt", "product_category": "fashion › clothing › shirt", "name": "casual slim fit shirt",
        "attributes": ["long sleeve", "machine wash"], "goal_options": ["red", "medium"], "price_upper": 40.0}


def test_reward_full_match_is_one():
    r, parts = ws.webshop_reward(product(), GOAL, 30.0, {"color": "red", "size": "medium"})
    assert r == 1.0 and parts == {"r_type": 1.0, "r_att": 1.0, "r_option": 1.0, "r_price": True}


def test_reward_partial_cases():
    full = {"color": "red", "size": "medium"}
    # one of two attributes: (1 + 2 + 1) / 5
    g = dict(GOAL, attributes=["long sleeve", "zip pocket"])
    assert ws.webshop_reward(product(), g, 30.0, full)[0] == pytest.approx(4 / 5)
    # one option not chosen: (2 + 1 + 1) / 5
    assert ws.webshop_reward(product(), GOAL, 30.0, {"color": "red"})[0] == pytest.approx(4 / 5)
    # wrong size (exact match only): (2 + 1 + 1) / 5
    assert ws.webshop_reward(product(), GOAL, 30.0, {"color": "red", "size": "large"})[0] == pytest.approx(0.8)
    # over the price bound: (2 + 2 + 0) / 5
    r, parts = ws.webshop_reward(product(), GOAL, 45.0, full)
    assert r == pytest.approx(4 / 5) and parts["r_price"] is False
    # nothing but the price: 1 / 5
    g = dict(GOAL, attributes=["zip pocket", "hooded collar"])
    assert ws.webshop_reward(product(), g, 10.0, {})[0] == pytest.approx(1 / 5)
    # no goal options: (2 + 1) / 3; an option that WebShop would still count (its value is in the title)
    # cannot push the reward above 1 (deviation 4)
    g = dict(GOAL, goal_options=[])
    red = product(Title="classic red long sleeve shirt")
    assert ws.option_match(red, "color", "red", [])
    assert ws.webshop_reward(red, g, 10.0, {"color": "red"})[0] == pytest.approx(1.0)
    assert ws.webshop_reward(red, g, 50.0, {"color": "red"})[0] == pytest.approx(2 / 3)


def test_reward_wrong_type():
    towel = product(query="towel", product_category="home › bath › towel", name="soft cotton towel",
                    Title="soft cotton towel")
    r, parts = ws.webshop_reward(towel, GOAL, 30.0, {"color": "red", "size": "medium"})
    assert r == 0.0 and parts["r_type"] == 0.0
    # 1 of 6 goal nouns shared, no query or category match -> 0.5; 1 of 11 -> 0.1
    g = dict(GOAL, query="q", product_category="a › b › c", name="alpha beta gamma delta epsilon shirt")
    assert ws.type_reward(product(), g)["r_type"] == 0.5
    g["name"] = "alpha beta gamma delta epsilon zeta eta theta iota kappa shirt"
    assert ws.type_reward(product(), g)["r_type"] == 0.1
    # same query with a name sharing no noun is still 0 (WebShop overrides the match with title_score)
    g["name"] = "alpha"
    assert ws.type_reward(product(), dict(g, query="shirt"))["r_type"] == 0.0
    # same category (2 shared levels) and one noun of two -> 1
    assert ws.type_reward(product(query="x"), GOAL)["r_type"] == 1.0


def test_fuzzy_and_colour_helpers():
    assert ws.token_set_ratio("fuzzy was a bear", "fuzzy fuzzy was a bear") == 100
    assert ws.token_set_ratio("long sleeve", "sleeve") == 100                   # token subset
    assert ws.token_set_ratio("Long-Sleeve!", "long sleeve") == 100
    assert ws.token_set_ratio("machine wash", "hand wash") < 85
    assert ws.token_set_ratio("", "x") == 0
    for s, want in [("", ""), ("black forest", "black"), ("navy blue", "blue"), ("webshop", "webshop")]:
        assert ws.normalize_color(s) == want
    # an option counts when its value appears in the product text (WebShop's fallback)
    p = product(Title="classic red long sleeve shirt")
    assert ws.option_match(p, "color", "red", ["blue"])
    assert not ws.option_match(product(), "color", "red", ["blue"])


# ----------------------------------------------------------------------------- loader

def write_mini_files(d):
    products = [
        {"asin": "B0A", "name": "Acme Soft Shirt", "full_description": "A soft shirt.",
         "small_description": "soft cotton", "pricing": "$10.50 to $20.00", "query": " Men Shirts ",
         "category": "fashion", "product_category": "Clothing › Men › Shirts", "images": ["u"],
         "customization_options": {"Color": [{"value": "Red/Blue ", "image": "u"}], "Size": None}},
        {"asin": "B0A", "name": "duplicate", "pricing": "$1.00", "query": "x", "category": "x",
         "product_category": "x", "customization_options": None, "small_description": []},
        {"asin": "nan", "name": "no asin", "query": "x"},
        {"asin": "B0B", "name": "Plain Mug", "full_description": "", "small_description": ["ceramic"],
         "pricing": "", "query": "mugs", "category": "kitchen", "product_category": "Home › Mugs",
         "customization_options": {}},
    ]
    attributes = {"B0A": {"attributes": ["soft cotton"], "instruction": "i need a soft shirt",
                          "instruction_attributes": ["soft cotton"]}}
    human = {"B0A": [{"asin": "B0A", "instruction": "i need a red shirt.", "instruction_attributes":
                      ["soft cotton"], "instruction_options": ["red | blue"]},
                     {"asin": "B0A", "instruction": "skipped", "instruction_attributes": [],
                      "instruction_options": []}]}
    reviews = [{"asin": "B0A", "reviews": [{"stars": 4, "review": "nice"}], "average_rating": 4.0}]
    for name, obj in [("items_shuffle_1000.json", products), ("items_ins_v2_1000.json", attributes),
                      ("items_human_ins.json", human), ("reviews.json", reviews)]:
        with open(os.path.join(d, name), "w") as f:
            json.dump(obj, f)


def test_loader_on_original_schema(tmp_path):
    write_mini_files(tmp_path)
    prods = ws.clean_products(*ws.read_files(str(tmp_path)))
    assert [p["asin"] for p in prods] == ["B0A", "B0B"]             # duplicate and 'nan' dropped
    a, b = prods
    assert a["Title"] == "Acme Soft Shirt" and a["BulletPoints"] == ["soft cotton"]
    assert a["options"] == {"color": ["red | blue"]} and a["query"] == "men shirts"
    assert a["pricing"] == [10.5, 20.0] and a["Price"] == "$10.5 to $20.0"
    assert a["Attributes"] == ["soft cotton"] and a["Rating"] == 4.0
    assert a["Reviews"] == [{"score": 4, "body": "nice"}] and len(a["instructions"]) == 2
    assert b["Attributes"] == ["DUMMY_ATTR"] and b["Price"] == "$100.0" and b["pricing"] == [100.0]
    assert b["Rating"] == "N.A." and b["Reviews"] == [] and "instructions" not in b
    prices = ws.product_prices(prods)
    assert 10.5 <= prices["B0A"] <= 20.0 and prices == ws.product_prices(prods)
    goals = ws.build_goals(prods, prices)
    assert len(goals) == 1                                           # the attribute-less one is skipped
    g = goals[0]
    bounds = [p for p in ws.PRICE_RANGE if p > prices["B0A"]][:4]
    assert g["price_upper"] in bounds[1:]
    assert g["instruction_text"] == f"i need a red shirt, and price lower than {g['price_upper']:.2f} dollars"
    assert g["attributes"] == ["soft cotton"] and g["goal_options"] == ["red | blue"]
    assert g["name"] == "Acme Soft Shirt" and g["query"] == "men shirts"
    assert ws.build_goals(prods, prices) == goals                    # deterministic
    # synthetic goals: one per option combination, options written into the text
    syn = ws.build_goals(ws.clean_products(*ws.read_files(str(tmp_path)), human_goals=False), prices,
                         human_goals=False)
    assert len(syn) == 1 and syn[0]["goal_options"] == {"color": "red | blue"}
    assert syn[0]["instruction_text"].startswith("i need a soft shirt with color: red | blue, and price")
    assert [p["asin"] for p in ws.clean_products(*ws.read_files(str(tmp_path)), num_products=1)] == ["B0A"]


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="items_shuffle"):
        ws.read_files(str(tmp_path))
    write_mini_files(tmp_path)
    with pytest.raises(ValueError, match="goals"):                   # 1 goal cannot be split
        ws.WebShopEnv(data_dir=str(tmp_path))


def test_written_catalogue_loads_like_the_generated_one(tmp_path, env):
    paths = ws.write_catalogue(str(tmp_path), 300)
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        ["items_shuffle.json", "items_ins_v2.json", "items_human_ins.json", "reviews.json"])
    loaded = ws.WebShopEnv(data_dir=str(tmp_path))
    assert loaded._shop.goals == env._shop.goals
    for seed in (0, 123, 378, 9999):
        assert loaded.reset(seed) == env.reset(seed)
        for _ in range(6):
            a = env.expert_action()
            assert loaded.expert_action() == a
            out = env.step(a)
            assert loaded.step(a)[:3] == out[:3]
            if out[2]:
                break


# ----------------------------------------------------------------------------- catalogue, split, determinism

def catalogue_problems(products: list[dict]) -> list[str]:
    """What would make the reward dishonest on a catalogue: an attribute the product lacks still counted
    (fuzzy or substring match), or a wrong option value counted as the goal's. Empty for the shipped one."""
    problems = []
    pool = sorted({a for p in products for a in p["Attributes"]})
    for p in products:
        for a in pool:
            if a not in p["Attributes"] and ws.attribute_matches(p, [a]):
                problems.append(f"{p['asin']}: attribute {a!r} counted but not listed")
        for oname, values in p["options"].items():
            for v in values:
                for other in values:
                    if other != v and ws.option_match(p, oname, v, [ws.normalize_color(other)]):
                        problems.append(f"{p['asin']}: {oname} {v!r} counted as {other!r}")
    return problems


def vocabulary(env) -> list[str]:
    """Distinct words a policy can meet in `env` (instruction, page furniture, products, goals), split as a
    word-level tokenizer with digit splitting would: letter runs, single digits, single symbols."""
    texts = [ws.INSTRUCTION, " ".join(env.actions), ws.BACK, ws.NEXT, ws.PREV, ws.BUY, " ".join(ws.SUBPAGES),
             "Search page: type search[words]. Results for : page of ( total) Price: , Rating: "
             "Selected: Description: Features: Reviews: none You bought ( no options). Score: 0.00"]
    for p in env._shop.products:
        texts += [p["asin"], p["Title"], p["Price"], str(p["Rating"]), ws._cut(p["Description"]),
                  ws._cut("; ".join(p["BulletPoints"]))]
        texts += [f"{k}: {' '.join(v)}" for k, v in p["options"].items()]
        texts += [f"({r['score']}) {r['body']}" for r in p["Reviews"]]
    texts += [g["instruction_text"] for g in env._shop.goals]
    words = set()
    for t in texts:
        words.update(re.findall(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]", t))
    return sorted(words)


def test_generated_catalogue_is_deterministic_and_honest(env):
    assert ws.generate_catalogue(50, 3) == ws.generate_catalogue(50, 3)
    assert ws.generate_catalogue(50, 3) != ws.generate_catalogue(50, 4)
    shop = env._shop
    assert len(shop.products) == 300 and len(shop.goals) == 900
    assert catalogue_problems(shop.products) == []
    words = [w for w in vocabulary(env) if w.isalpha()]
    assert 150 <= len(words) <= 450, len(words)


def test_split_eval_goals_never_train(env):
    perm = env._shop.perm
    eval_goals = [ws.goal_index(s, perm) for s in ws.EVAL_SEEDS]
    assert len(set(eval_goals)) == 256
    train_goals = {ws.goal_index(s, perm) for s in range(0, 20000) if s not in ws.EVAL_SEEDS}
    assert train_goals.isdisjoint(eval_goals) and len(train_goals) == len(perm) - 256
    # large goal sets hold out RAGEN's 500: eval seed s -> perm[s % 500], training -> perm[500:]
    big = list(range(2000))
    random.Random(0).shuffle(big)
    assert [ws.goal_index(s, big) for s in ws.EVAL_SEEDS] == big[123:379]
    assert {ws.goal_index(s, big) for s in range(379, 5000)} == set(big[500:])
    assert env.reset(200) and env.goal is env._shop.goals[ws.goal_index(200, perm)]


def test_determinism_per_seed():
    def transcript(seed, policy_seed):
        e, rng = ws.WebShopEnv(), random.Random(policy_seed)
        out = [e.reset(seed)]
        for _ in range(9):
            o, r, d, info = e.step(rng.choice(e.available_actions()))
            out.append((o, r, d, info["action_is_valid"], info["action_is_effective"]))
            if d:
                break
        return out
    for seed in (0, 5, 150):
        assert transcript(seed, 7) == transcript(seed, 7)
    firsts = {ws.WebShopEnv().reset(s) for s in range(50)}
    assert len(firsts) > 40


def test_deepcopy_shares_the_shop(env):
    env.reset(123)
    clone = copy.deepcopy(env)
    assert clone._shop is env._shop
    clone.step(clone.expert_action())
    assert clone.render() != env.render() and env.render() == env.reset(123)


def test_overrides_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown webshop override 'colour'.*allowed: data_dir"):
        ws.WebShopEnv(colour=1)
    for bad in [dict(num_products=0), dict(num_products=1000), dict(num_products="10"),
                dict(num_products=True), dict(page_size=0), dict(max_results=-1), dict(human_goals="yes"),
                dict(repeat_instruction=1), dict(catalogue_seed=1.5), dict(data_dir=str(tmp_path / "nope")),
                dict(data_dir=3)]:
        key = next(iter(bad))
        with pytest.raises(ValueError, match=key):
            ws.WebShopEnv(**bad)
    with pytest.raises(ValueError, match="goals"):
        ws.WebShopEnv(num_products=50)          # 150 goals: too few for 256 held-out eval goals


# ----------------------------------------------------------------------------- expert and random baselines

def run_policy(policy: str, seeds, max_actions: int = ws.RAGEN_BUDGET["max_actions"], policy_seed: int = 0,
               **overrides) -> dict:
    """Success rate and mean actions of 'random' (uniform over env.available_actions()) or 'expert'."""
    rng = random.Random(policy_seed)
    env = ws.WebShopEnv(**overrides)
    wins, n_actions, seeds = 0, 0, list(seeds)
    for s in seeds:
        env.reset(s)
        info = {"success": False}
        for _ in range(max_actions):
            a = env.expert_action() if policy == "expert" else rng.choice(env.available_actions())
            _, _, done, info = env.step(a)
            n_actions += 1
            if done:
                break
        wins += int(info["success"])
    return {"success": wins / len(seeds), "mean_actions": n_actions / len(seeds)}


def test_expert_success_on_eval_goals():
    res = run_policy("expert", ws.EVAL_SEEDS, max_actions=ws.RAGEN_BUDGET["max_actions"])
    assert res["success"] >= 0.95 and res["mean_actions"] <= 6, res


def test_expert_on_synthetic_goals():
    res = run_policy("expert", list(ws.EVAL_SEEDS)[:64], max_actions=9, human_goals=False)
    assert res["success"] >= 0.9, res


def test_random_policy_rarely_succeeds():
    res = run_policy("random", ws.EVAL_SEEDS, max_actions=9)
    assert res["success"] <= 0.05 and res["mean_actions"] > 5, res
