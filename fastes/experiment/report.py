"""report.md, written from the metrics: what the numbers say first, then setup, budgets, results, every
plot with a reading of it, and the caveats."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from fastes.analysis.passk import pass_at_k

from .budget import ARMS, LABELS, MODELS
from .findings import paired_difference, paired_standard_error, standard_error
from .plots import PLOTS
from .seeds import headline, verdict

VERDICT_GROUPS = [
    ("yes", "Reproduced"),
    ("partly", "Partly reproduced"),
    ("no", "Not reproduced"),
    ("within", "Too close to call (within noise)"),
    ("not", "Not tested"),
]


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; a "|" inside a cell (as in ||delta||) is escaped so it does not split the cell."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|", *map(line, rows)])


def json_text(value: Any) -> str:
    """Indented JSON with every list of plain numbers on one line (per-prompt results stay short)."""
    text = json.dumps(value, indent=2)
    numbers = re.compile(r"\[\s+([-+0-9.eE,\s]+?)\s+\]")
    return numbers.sub(lambda match: "[" + " ".join(match.group(1).split()) + "]", text) + "\n"


# --- what the numbers say ---------------------------------------------------------------------------


def _pass_sign(metrics: dict[str, Any], name: str, k: int) -> int:
    """Paired comparison of model `name`'s per-prompt Pass@k with the base's."""
    n, models = metrics["preset"]["passk_samples"], metrics["models"]
    a, b = (pass_at_k(n, models[m]["correct_counts"], k) for m in (name, "base"))
    return paired_difference(a, b)


def _arm_sentence(metrics: dict[str, Any], arm: str) -> str:
    """What one arm did to the base model, in a sentence with the paired verdicts."""
    n = metrics["preset"]["passk_samples"]
    top, m, base = str(n), metrics["models"][arm], metrics["models"]["base"]
    moved = {1: "raised", 0: "did not clearly change", -1: "lowered"}
    greedy = paired_difference(m["greedy_correct"], base["greedy_correct"])
    gain = m["greedy_accuracy"] - base["greedy_accuracy"]
    se = paired_standard_error(m["greedy_correct"], base["greedy_correct"])
    entropy_change = m["probe_entropy"] / base["probe_entropy"] - 1
    return (
        f"- {LABELS[arm]} {moved[greedy]} greedy accuracy ({base['greedy_accuracy']:.3f} -> "
        f"{m['greedy_accuracy']:.3f}, {gain:+.3f} +- {se:.3f} paired SE), "
        f"{moved[_pass_sign(metrics, arm, 1)]} Pass@1 ({base['pass_at_k']['1']:.3f} -> "
        f"{m['pass_at_k']['1']:.3f}) and {moved[_pass_sign(metrics, arm, n)]} Pass@{top} "
        f"({base['pass_at_k'][top]:.3f} -> {m['pass_at_k'][top]:.3f}); its entropy changed by "
        f"{entropy_change:+.0%} and its token KL to the base on held-out prompts is "
        f"{m['heldout_kl_to_base']:.3f} nats."
    )


def _es_caveat(metrics: dict[str, Any]) -> list[str]:
    """When ES did not clearly improve the base, what that means for the other findings."""
    models, top = metrics["models"], str(metrics["preset"]["passk_samples"])
    es, grpo = models["es"], models["grpo"]
    if paired_difference(es["greedy_correct"], models["base"]["greedy_correct"]) > 0:
        return []
    text = (
        "\nES did not clearly improve the base at this budget, so the findings about where ES's gains "
        "come from cannot be tested here."
    )
    closer = es["heldout_kl_to_base"] < grpo["heldout_kl_to_base"]
    if _pass_sign(metrics, "es", int(top)) <= 0 and es["pass_at_k"][top] > grpo["pass_at_k"][top] and closer:
        text += (
            f" ES's Pass@{top} beats GRPO's by staying close to the base (KL "
            f"{es['heldout_kl_to_base']:.3f} vs {grpo['heldout_kl_to_base']:.3f} nats), not by "
            "widening coverage beyond it."
        )
    return [text]


def _summary(metrics: dict[str, Any]) -> list[str]:
    """The title, the command, and what the numbers say: verdict counts, each arm, each finding."""
    p, models, found = metrics["preset"], metrics["models"], metrics["findings"]
    groups = {
        key: [f["claim"] for f in found if f["verdict"].split(" ")[0] == key] for key, _ in VERDICT_GROUPS
    }
    tested = len(found) - len(groups["not"])
    se_greedy = standard_error(models["base"]["greedy_accuracy"], p["eval_size"])
    command = f"fastes experiment --preset {p['name']}" + (
        f" --model {metrics['model']}" if metrics["custom_model"] else ""
    )
    if p["seed"]:
        command += f" --seed {p['seed']}"
    return [
        f"# ES vs GRPO at equal sample budgets ({p['name']} preset)",
        "",
        f"`{command}` -- model `{metrics['model']}` ({metrics['params']:,} parameters), task `{p['task']}`, "
        f"seed {p['seed']}, {metrics['timings']['total'] / 60:.1f} minutes on {metrics['device']}.",
        "",
        "## What the numbers say",
        "",
        f"This run reproduces **{len(groups['yes'])} of the {tested}** findings of the seed paper that it "
        f"could test. A difference between two models counts only when it exceeds two standard errors "
        "of the mean per-prompt difference on the same prompts (a paired test); for reference, one "
        f"standard error of a single accuracy near {models['base']['greedy_accuracy']:.2f} on "
        f"{p['eval_size']} prompts is {se_greedy:.3f}.",
        "",
        "What each arm did to the base model:",
        "",
        *(_arm_sentence(metrics, arm) for arm in ARMS),
        *_es_caveat(metrics),
        "",
        "The paper's findings, one by one:",
        "",
        *(f"- **{title}:** {'; '.join(groups[key])}." for key, title in VERDICT_GROUPS if groups[key]),
        "",
        table(
            ["paper's finding", "measured here", "reproduced?"],
            [[f["claim"], f["measured"], f["verdict"]] for f in found],
        ),
        "",
    ]


# --- setup, budgets, results ------------------------------------------------------------------------


def _setup(metrics: dict[str, Any]) -> list[str]:
    p, models, curves = metrics["preset"], metrics["models"], metrics["training"]
    return [
        "## Setup",
        "",
        f"- Base model: `{metrics['model']}`; every arm starts from it. Task `{p['task']}`: reward = "
        f"{p['format_weight']:g} x format + answer, greedy test accuracy on {p['eval_size']} test prompts.",
        f"- ES: population {p['population']} (antithetic), {p['es_batch']} prompts per iteration, sigma "
        f"{p['sigma']:g}, lr {p['es_lr']:g}, centered-rank shaping, greedy decoding.",
        f"- Prompts: {_prompts(metrics)}.",
        f"- GRPO: {p['grpo_batch']} prompts x {p['num_generations']} generations per step, temperature "
        f"{p['temperature']:g}, "
        f"lr {p['grpo_lr']:g} (AdamW), DAPO loss, no KL term.",
        f"- GRPO->ES: GRPO for half the GRPO budget (the GRPO arm's model at step "
        f"{curves['grpo_es']['grpo_steps']}), then ES for half the ES iterations.",
        f"- Evaluation: Pass@K (unbiased estimator) from {p['passk_samples']} samples at "
        f"T={p['temperature']:g} on {p['passk_prompts']} test prompts; entropy probe: {p['probe_samples']} "
        f"samples of each of {p['probe_prompts']} test prompts at every evaluation point; held-out tasks "
        f"{', '.join(models['base']['heldout_accuracy'])} ({p['heldout_size']} test prompts each, KL on "
        f"{p['kl_samples']} samples per prompt); perplexity "
        + (
            "of fastes' general-English corpus (fastes/assets/general_text.txt)."
            if p["perplexity_corpus"] == "text"
            else "of the held-out tasks' solutions given their prompts."
        ),
        "",
    ]


def _prompts(metrics: dict[str, Any]) -> str:
    """How the run wrote its prompts (the same for training and every measurement)."""
    settings = metrics["prompt_settings"]
    text = f"{settings['prompt_style']} style, chat template {settings['chat_template']}"
    text += (
        f", system prompt {settings['system_prompt']!r}"
        if settings["system_prompt"]
        else ", no system prompt"
    )
    if settings["instruction"]:
        text += f", instruction {settings['instruction']!r}"
    if settings.get("answer_prefix", "auto") != "auto":  # absent from metrics written before it existed
        text += f", answer prefix {settings['answer_prefix']!r}"
    return text + f", at most {settings['max_new_tokens']} new tokens"


def _budgets(metrics: dict[str, Any]) -> list[str]:
    curves = metrics["training"]
    rows = [
        [
            LABELS[arm],
            str(curves[arm]["grpo_steps"]),
            str(curves[arm]["es_iterations"]),
            f"{curves[arm]['samples']:,}",
            f"{curves[arm]['seconds']:.0f}" + (" (ES phase)" if arm == "grpo_es" else ""),
        ]
        for arm in ARMS
    ]
    return [
        "## Sample budgets",
        "",
        "A training completion is one generated answer: ES generates population x prompts of them per "
        "iteration (every member answers every prompt), GRPO prompts x generations per step.",
        "",
        table(["arm", "GRPO steps", "ES iterations", "training completions", "training seconds"], rows),
        "",
    ]


def _results(metrics: dict[str, Any]) -> list[str]:
    models, top = metrics["models"], str(metrics["preset"]["passk_samples"])
    heldout = list(models["base"]["heldout_accuracy"])
    header = ["model", "greedy acc", "format", "lenient acc", "Pass@1", f"Pass@{top}", *heldout]
    rows = [
        [
            LABELS[n],
            f"{m['greedy_accuracy']:.3f}",
            f"{m['format_rate']:.3f}",
            "-" if m["lenient_accuracy"] is None else f"{m['lenient_accuracy']:.3f}",
            f"{m['pass_at_k']['1']:.3f}",
            f"{m['pass_at_k'][top]:.3f}",
            *(f"{v:.3f}" for v in m["heldout_accuracy"].values()),
            f"{m['heldout_perplexity']:.3f}",
            f"{m['heldout_kl_to_base']:.4f}",
            f"{m['relative_update_norm']:.2e}",
            f"{m['probe_entropy']:.3f}",
        ]
        for n, m in models.items()
    ]
    return [
        "## Results",
        "",
        table([*header, "perplexity", "KL to base", "||delta||/||theta||", "entropy"], rows),
        "",
        "Format: share of greedy answers in the verifiable format; lenient acc: answers read leniently "
        "(instruct forms: the last number when none is stated). Entropy: mean token entropy (nats) of the "
        "model on its own samples of the probe prompts.",
        "",
    ]


# --- plots ------------------------------------------------------------------------------------------


def _sweep_text(metrics: dict[str, Any], metric: str, fmt: str) -> str:
    return "; ".join(
        f"{size}: base {info['base_accuracy']:.3f}, "
        + ", ".join(
            f"N={n} -> {r[metric]:{fmt}} ({r['iterations']} iterations)" for n, r in info["runs"].items()
        )
        for size, info in metrics["population_sweep"].items()
    )


def _gain_text(metrics: dict[str, Any]) -> str:
    gain, models = metrics["gain_retained"], metrics["models"]
    accuracy = gain["accuracy"]
    by_share = ", ".join(
        f"{float(f):.1%}: top {accuracy['top'][f]:.3f} / random {accuracy['random'][f]:.3f} / "
        f"bottom {accuracy['bottom'][f]:.3f}"
        for f in sorted(accuracy["top"], key=float)
    )
    text = (
        f"theta_0 + M * delta for the ES model (delta = ES - base over the {gain['changed_elements']:,} "
        f"elements ES changed; M keeps a share of them). Base accuracy {gain['accuracy_base']:.3f}, ES "
        f"{gain['accuracy_trained']:.3f}; accuracies by kept share: {by_share}."
    )
    if paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"]) <= 0:
        text += (
            " ES's own gain is not clearly above zero here, so the gain-retained ratios divide noise by "
            "noise (undefined when ES gained exactly nothing); read the accuracies instead."
        )
    return text


def _model_values(metrics: dict[str, Any], value: str, fmt: str = ".3f") -> str:
    return ", ".join(f"{LABELS[n]} {metrics['models'][n][value]:{fmt}}" for n in MODELS)


def _plot_texts(metrics: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(plot key, title, one-paragraph reading of the plot from the numbers) for every figure."""
    p, models, curves = metrics["preset"], metrics["models"], metrics["training"]
    top = str(p["passk_samples"])
    best = max(models[n]["pass_at_k"][top] for n in MODELS)
    leaders = " and ".join(LABELS[n] for n in MODELS if models[n]["pass_at_k"][top] == best)
    passes = "; ".join(
        f"{LABELS[n]} {models[n]['pass_at_k']['1']:.3f} -> {models[n]['pass_at_k'][top]:.3f}" for n in MODELS
    )
    js_phase = [v for _, v in curves["grpo_es"]["js_diversity"]]
    js_text = f", {np.mean(js_phase):.3f} for the ES phase of GRPO->ES." if js_phase else "."
    accuracy = "; ".join(
        f"{LABELS[a]} {curves[a]['test_accuracy'][0][1]:.3f} -> {curves[a]['test_accuracy'][-1][1]:.3f}"
        for a in ARMS
    )
    heldout = "; ".join(
        f"{LABELS[n]} " + ", ".join(f"{t} {v:.3f}" for t, v in models[n]["heldout_accuracy"].items())
        for n in MODELS
    )
    entropy = ", ".join(f"{LABELS[a]} {curves[a]['probe_entropy'][-1][1]:.3f}" for a in ARMS)
    rewards = "; ".join(
        f"{size}: " + ", ".join(f"N={n} -> {r['test_reward']:.3f}" for n, r in info["runs"].items())
        for size, info in metrics["population_sweep"].items()
    )
    return [
        ("pass_at_k", "Pass@K", f"Pass@1 -> Pass@{top}: {passes}. Highest Pass@{top}: {leaders}."),
        (
            "entropy",
            "Token entropy over training",
            "Each arm's entropy on its own samples of the same probe prompts, against training "
            "completions generated; the GRPO (logged) line is the entropy GRPO logs on its training "
            f"batches. Final probe entropy: {entropy} (base {curves['es']['probe_entropy'][0][1]:.3f}).",
        ),
        (
            "js_diversity",
            "JS diversity of the ES population",
            "Verifier-projected JS diversity of the population's greedy outcomes on each iteration's batch, "
            f"divided by ln 2: mean {np.mean([v for _, v in curves['es']['js_diversity']]):.3f} for the ES "
            f"arm{js_text}",
        ),
        (
            "accuracy",
            "Test accuracy over training",
            f"Greedy test accuracy at every evaluation point: {accuracy}.",
        ),
        ("gain_retained", "Gain retained by sparse ES updates", _gain_text(metrics)),
        ("heldout_accuracy", "Held-out accuracy", f"Greedy accuracy on tasks no arm trained on: {heldout}."),
        (
            "heldout_perplexity",
            "Held-out perplexity",
            "Perplexity of the fixed held-out corpus (the reference solutions given their prompts): "
            f"{_model_values(metrics, 'heldout_perplexity')}.",
        ),
        (
            "heldout_kl",
            "Token KL to the base on held-out prompts",
            "Mean KL(model || base) per token of the model's own samples on held-out prompts: "
            f"{_model_values(metrics, 'heldout_kl_to_base', '.4f')}.",
        ),
        (
            "sweep_accuracy",
            "Population-size sweep: accuracy",
            f"ES with N members at a fixed budget of {p['sweep_budget']:,} training completions (smaller N "
            f"gets more iterations): {_sweep_text(metrics, 'test_accuracy', '.3f')}.",
        ),
        (
            "sweep_reward",
            "Population-size sweep: reward",
            f"Final greedy test reward ({p['format_weight']:g} x format + answer) per N: {rewards}.",
        ),
    ]


def _plots(metrics: dict[str, Any]) -> list[str]:
    lines = ["## Plots", ""]
    for key, title, text in _plot_texts(metrics):
        lines += [f"### {title}", "", f"![{title}]({PLOTS[key]})", "", text, ""]
    return lines


def _over_seeds(metrics: dict[str, Any], others: dict[str, dict[str, Any]]) -> list[str]:
    """ES vs GRPO at greedy accuracy, Pass@1 and Pass@n, seed by seed (this run and the seed folders
    beside it), and over seeds."""
    if not others:
        return []
    found = headline([metrics, *others.values()])
    p = metrics["preset"]
    folders = {run["preset"]["seed"]: name for name, run in others.items()}

    def diff(value: tuple[float, float]) -> str:
        return f"{value[0]:+.3f} +- {value[1]:.3f}"

    rows = []
    for name in found["mean"]:
        for row in found["seeds"]:
            seed = row["seed"]
            where = f"[{seed}]({folders[seed]}/metrics.json)" if seed in folders else f"{seed} (this run)"
            values = row["measures"][name]
            rows.append(
                [
                    name,
                    where,
                    *(f"{values[m]:.3f}" for m in ("base", "es", "grpo")),
                    diff(values["es_minus_grpo"]),
                ]
            )
        rows.append([name, "**mean**", "", "", "", f"**{diff(found['mean'][name])}**"])
    verdicts = "; ".join(f"{name}: **{verdict(value)}**" for name, value in found["mean"].items())
    return [
        "## ES vs GRPO over seeds",
        "",
        f"The headline comparison on {len(found['seeds'])} training seeds (the other seeds trained the ES "
        "and GRPO arms only, with every other setting the same, and were evaluated on the same test "
        f"problems). Greedy is Pass@1 at temperature 0 on {p['eval_size']} problems; Pass@1 and "
        f"Pass@{p['passk_samples']} are sampled at temperature {p['temperature']:g}, "
        f"{p['passk_samples']} samples of each of {p['passk_prompts']} problems. ES - GRPO is the mean "
        "per-problem difference +- its paired standard error; the mean's SE combines the seeds' SEs.",
        "",
        table(["measure", "seed", "base", "ES", "GRPO", "ES - GRPO"], rows),
        "",
        f"Over the seeds (a difference counts when it exceeds two standard errors): {verdicts}.",
        "",
    ]


def _caveats(metrics: dict[str, Any], others: dict[str, dict[str, Any]]) -> list[str]:
    p = metrics["preset"]
    se_greedy = standard_error(metrics["models"]["base"]["greedy_accuracy"], p["eval_size"])
    if p["model"] and not metrics["custom_model"]:
        about_models = f"- One model (`{metrics['model']}`) with the {p['name']} preset's settings."
    elif metrics["custom_model"]:
        about_models = (
            f"- One model (`{metrics['model']}`) with the {p['name']} preset's settings, which were tuned "
            "for the built-in tiny model, not for this one."
        )
    else:
        about_models = (
            "- The models are tiny character-level Llamas pretrained on the tasks themselves, not the "
            "0.5B-8B models of the paper; population sizes, sigma and budgets are scaled down to match."
        )
    seeds_text = (
        f"{len(others) + 1} seeds for ES vs GRPO (above); every other figure is from seed {p['seed']} alone."
        if others
        else "One seed."
    )
    style_mix = metrics.get("base_pretraining", {}).get("style_mix", 0.0)
    if style_mix:
        about_models += (
            f"\n- The base was pretrained with style_mix {style_mix:g}: that share of its countdown "
            'solutions was written "expression=target;", a style the verifier refuses, and the base '
            "answers that way on many prompts. A large part of every arm's countdown gain is learning "
            "to answer in the verifiable style, and ES's gain is mostly that (docs/es_small_scale.md): "
            "the findings about ES's gains are about this kind of gain."
        )
    return [
        "## Caveats",
        "",
        about_models,
        f"- {seeds_text} Accuracies on {p['eval_size']} prompts move by a standard error of about "
        f"{se_greedy:.3f} from sampling the test set alone, so small differences between arms are not "
        "findings.",
        f"- {p['tuning']}",
        "",
    ]


def write_report(
    metrics: dict[str, Any], out_dir: Path, others: dict[str, dict[str, Any]] | None = None
) -> Path:
    """report.md: what the numbers say, ES vs GRPO over seeds (when `others`, {seed folder: metrics},
    holds more seeds: seeds.other_seeds), setup, budgets, results, every plot with what it shows, and
    the caveats."""
    others = others or {}
    lines = [
        *_summary(metrics),
        *_over_seeds(metrics, others),
        *(line for section in (_setup, _budgets, _results, _plots) for line in section(metrics)),
        *_caveats(metrics, others),
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
