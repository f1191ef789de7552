"""The style registry of the embedded model: style names, prompt phrasings, prompt -> style resolution.

The model is conditioned on the pooled MiniLM sentence embedding of the prompt. It was trained on
the phrasings below, so a new prompt is judged by its cosine similarity to each style's prototype
(the normalised mean of its phrasings' embeddings): the nearest styles are reported, and a prompt
whose best similarity is below ``too_far_below`` is flagged so the caller can tell the user which
styles exist instead of silently producing an arbitrary look.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.capabilities import look_name
from engine.text import TextEncoder, load_text_encoder

STYLE_PROMPTS: dict[str, tuple[str, ...]] = {
    "pencil_sketch": ("pencil sketch", "a graphite drawing", "sketched by hand", "black and white pencil drawing"),
    "cartoon": ("cartoon", "a cel-shaded cartoon", "comic book style with outlines", "animated cartoon look"),
    "oil_paint": ("oil painting", "an oil paint canvas", "painted with thick brush strokes", "classical oil portrait"),
    "watercolor": ("watercolor", "a watercolour painting", "soft watercolor wash on paper", "aquarelle"),
    "neon": ("neon edges", "glowing neon lines", "cyberpunk neon outline", "electric glow edges on black"),
    "thermal": ("thermal camera", "infrared heat map", "a thermal imaging view", "heat vision"),
    "sepia_film": ("sepia film", "an old sepia photograph", "vintage film look", "antique brown photo"),
    "pixel_art": ("pixel art", "8-bit retro game graphics", "low resolution pixelated", "a retro video game sprite look"),
    "night_vision": ("night vision", "green night vision goggles", "military night-vision camera", "green phosphor view"),
    "pop_art": ("pop art", "a warhol style poster", "bold posterized pop art colors", "screen-printed pop poster"),
    "charcoal": ("charcoal drawing", "smudged charcoal sketch", "a dark charcoal study on paper", "charcoal and graphite artwork"),
    "comic_ink": ("comic ink", "black and white ink comic", "inked manga panel", "bold black ink illustration"),
    "blueprint": ("blueprint", "an architectural blueprint", "white lines on blue technical drawing", "engineering blueprint schematic"),
    "vaporwave": ("vaporwave", "pink and cyan vaporwave aesthetic", "retro 80s synthwave colors", "a vaporwave color grade"),
    "cyanotype": ("cyanotype", "a prussian blue sun print", "cyanotype photograph", "blue and white cyanotype print"),
    "noir": ("film noir", "high contrast black and white film", "a noir detective movie", "dramatic monochrome noir"),
    "woodblock": ("woodblock print", "a japanese woodcut", "ukiyo-e style print", "carved woodblock illustration"),
    "chalkboard": ("chalkboard drawing", "white chalk on a blackboard", "a chalk sketch on a green board", "chalk drawing on slate"),
    "x_ray": ("x-ray", "an x-ray image", "medical x-ray scan", "radiograph"),
    "cinematic": ("cinematic teal and orange", "a hollywood movie color grade", "blockbuster film look", "teal and orange grading"),
    "golden_hour": ("golden hour", "warm sunset light", "glowing golden evening sun", "late afternoon golden light"),
}


# Trained but not shipped: the tiny model does not learn these looks well enough, so the registry leaves
# them out and a prompt asking for one gets the far-prompt notice or the nearest shipped look instead.
# All four are thin bright or dark lines placed by the content's edges: neon (~12 dB, its output stays
# closer to the oil-paint teacher than to its own), and after 2500 + 1500 fine-tune steps comic ink
# (17.3 dB), blueprint (16.1) and chalkboard (17.3) on held-out clips 0-1, against >= 20 for shipping.
# Teachers whose look is a tone or colour mapping of the content reach 22-25 dB in the same steps.
# x-ray passes on fidelity (23.4 dB) but keeps the DiT's 16-px patch seams: 1.49x the gradient energy
# on the grid after deblocking on the held-out photographs, against the 1.2x every shipped look meets.
NOT_SHIPPED: frozenset[str] = frozenset({"neon", "comic_ink", "blueprint", "chalkboard", "x_ray"})

# A prompt is far from every look when its best cosine similarity to a look's prototype is below
# this. Chosen on the two lists in engine/embedded/prompt_lists/ (tests/test_embedded_styles.py holds
# it to them) and the looks' own names: every shipped phrasing and paraphrase but one ("sepia tone",
# 0.51) is at 0.60 or above, every look's name at 0.54 or above ("cinematic" 0.54, its phrasings say
# "cinematic teal and orange"), and of the 62 unrelated prompts only "a chalkboard drawing" (0.67,
# near the pencil sketch) and "sunset over the mountains" (0.58, near golden hour) are above 0.52
# ("a claymation character" 0.51). 0.53 sits in that gap; the first shipped 0.35 let "underwater
# scene" (0.45) and a third of the unrelated prompts through without a word.
FAR_BELOW = 0.53
# Look anchoring (engine/streaming/prompts.py ``LookAnchors``): a prompt is served as its two nearest looks'
# prototypes mixed by a softmax of its similarities at this temperature. A trained phrasing is 0.1-0.3
# nearer its own look than the next (weight of the next <= 0.12 at 0.1, which the DiT draws as ~2 % of
# the way to that look); a prompt equally near two gets half of each. The DiT's picture moves along the
# slerp between two prototypes as a steep S (measured: 35 % of one look's weight draws 11 % of the way
# to it, 65 % draws 89 %), so a softer softmax keeps a prompt between two looks visibly between them:
# 0.05 serves "a charcoal pencil drawing" (0.03 nearer charcoal) 65/35, drawn ~12 % of the way from
# charcoal; 0.03 served it 73/27, drawn 3 % of the way by the DiT re-tuned to input noise 0.
LOOK_TEMPERATURE = 0.05
PROMPT_LISTS = Path(__file__).resolve().parent / "prompt_lists"


def prompt_list(name: str) -> list[str]:
    """A prompt list of engine/embedded/prompt_lists/ (``unrelated``, ``shipped`` or ``two_looks``): one
    prompt per line, '#' starts a comment line."""
    lines = (PROMPT_LISTS / f"{name}.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def two_look_prompts() -> list[tuple[str, tuple[str, str]]]:
    """engine/embedded/prompt_lists/two_looks.txt: prompts naming two shipped looks, with those looks."""
    pairs = []
    for line in prompt_list("two_looks"):
        prompt, _, looks = line.partition("->")
        first, second = (name.strip() for name in looks.split(","))
        pairs.append((prompt.strip(), (first, second)))
    return pairs


@dataclass(frozen=True)
class StyleMatch:
    """How a prompt maps onto the trained styles: best first, with cosine similarities."""

    prompt: str
    nearest: tuple[tuple[str, float], ...]
    too_far: bool

    @property
    def style(self) -> str:
        return self.nearest[0][0]

    def message(self) -> str:
        """Names only the looks it was matched against (the shipped ones: never one left out)."""
        names = ", ".join(f"{look_name(name)} ({sim:.2f})" for name, sim in self.nearest[:3])
        if self.too_far:
            every = ", ".join(look_name(name) for name, _ in self.nearest)
            return (
                f"prompt {self.prompt!r} is far from every look this model ships, so its look will be an "
                f"arbitrary mix; nearest: {names}. Try one of: {every}"
            )
        return f"prompt {self.prompt!r} -> {names}"



def prototypes(pooled: torch.Tensor, style_names: list[str], prompts_per_style: int) -> torch.Tensor:
    """Per-style prototype [S, D]: normalised mean of that style's normalised phrasing embeddings."""
    e = torch.nn.functional.normalize(pooled.float(), dim=-1).reshape(len(style_names), prompts_per_style, -1)
    return torch.nn.functional.normalize(e.mean(dim=1), dim=-1)


def match_style(
    prompt: str, prompt_embedding: torch.Tensor, style_names: list[str], protos: torch.Tensor, too_far_below: float
) -> StyleMatch:
    """Rank styles by cosine similarity of ``prompt_embedding`` [D] to the prototypes [S, D]."""
    if protos.shape[0] != len(style_names):
        raise ValueError(f"{protos.shape[0]} prototypes for {len(style_names)} style names")
    sims = torch.nn.functional.normalize(prompt_embedding.float().reshape(-1), dim=0) @ protos.float().T
    order = torch.argsort(sims, descending=True).tolist()
    nearest = tuple((style_names[i], float(sims[i])) for i in order)
    return StyleMatch(prompt=prompt, nearest=nearest, too_far=nearest[0][1] < too_far_below)


def style_phrasings() -> tuple[list[str], list[str]]:
    """(style names, all phrasings flattened style-major); every style has the same number of phrasings."""
    names = list(STYLE_PROMPTS)
    counts = {len(p) for p in STYLE_PROMPTS.values()}
    if len(counts) != 1:
        raise ValueError(f"every style needs the same number of phrasings, got {counts}")
    return names, [p for name in names for p in STYLE_PROMPTS[name]]


_ENCODER: TextEncoder | None = None


def pooled_embeddings(prompts: list[str]) -> torch.Tensor:
    """L2-normalised pooled MiniLM sentence embeddings [N, 384] (the model's text conditioning)."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = load_text_encoder("minilm")
    return torch.nn.functional.normalize(_ENCODER.pooled(prompts).float(), dim=-1)
