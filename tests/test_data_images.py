"""Prompt images: image items to bytes, headers and decoding, placeholders, and the vision renderer's token ids
against the Hugging Face processor of a tiny Qwen2.5-VL built here."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from rl360.core import ImagePrompt
from rl360.data import DataError, PromptRenderer
from rl360.data.images import (
    VisionProcessor,
    header_size,
    image_bytes,
    is_vision_model,
    open_image,
    place_images,
    processor_chat_template,
    row_images,
    upscaled_size,
)
from rl360.quickstart.vision_assets import build_vision_quickstart_model

TEXTS = ["Find x in the figure.", "Which shape is larger?", "Compare them."]


def _image(width, height, seed=0, mode="RGB", fmt="PNG"):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels if len(mode) > 1 else pixels[..., 0], mode).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_vision_quickstart_model(tmp_path_factory.mktemp("tiny_vl"), texts=TEXTS)


def _hf_processor(model_dir, monkeypatch, **bounds):
    """The model's own Hugging Face processor: AutoProcessor, or where its video processor cannot load (it needs
    torchvision, which the CPU install lacks) the same Qwen2_5_VLProcessor built from its parts, with only the
    constructor's class check of that unused video processor switched off."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2_5_VLProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir, **bounds)
    except ImportError:
        monkeypatch.setattr(Qwen2_5_VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
        return Qwen2_5_VLProcessor(image_processor=AutoImageProcessor.from_pretrained(model_dir, **bounds),
                                   tokenizer=AutoTokenizer.from_pretrained(model_dir), video_processor=None,
                                   chat_template=processor_chat_template(model_dir))


def _hf_ids(processor, messages, images):
    """What verl feeds a Qwen-VL model: the processor's chat template, then processor(text, images)."""
    text = processor.apply_chat_template(place_images(messages, len(images), "ref"), add_generation_prompt=True,
                                         tokenize=False)
    out = processor(text=[text], images=[open_image(data) for data in images] or None)
    return [int(token) for token in out["input_ids"][0]]


# ----- image items ---------------------------------------------------------------------------------------------

def test_image_bytes_from_every_item_form(tmp_path):
    png = _image(30, 30)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png)
    assert image_bytes(png, "w") == png
    assert image_bytes({"bytes": png, "path": "ignored.png"}, "w") == png
    assert image_bytes({"bytes": None, "path": "imgs/a.png"}, "w", base_dir=tmp_path) == png
    assert image_bytes("imgs/a.png", "w", base_dir=tmp_path) == png
    assert image_bytes(str(tmp_path / "imgs" / "a.png"), "w", base_dir="/elsewhere") == png  # absolute path


@pytest.mark.parametrize("item, message", [
    (b"", r"data\.parquet row 4: key 'images'\[1\]: the image is empty"),
    ({"bytes": None, "path": None}, r"row 4: key 'images'\[1\]: the image has neither 'bytes' nor 'path'"),
    ("missing.png", r"row 4: key 'images'\[1\]: cannot read image file '.*missing\.png'"),
    (7, r"row 4: key 'images'\[1\]: an image must be bytes, a path or a \{bytes, path\} dict, got int"),
])
def test_bad_image_items_name_file_row_and_index(tmp_path, item, message):
    row = {"images": [_image(30, 30), item], "_source": {"file": str(tmp_path / "data.parquet"), "row": 4}}
    with pytest.raises(DataError, match=message):
        row_images(row)


def test_row_images_resolve_paths_against_the_files_directory(tmp_path):
    png = _image(40, 30)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "p.png").write_bytes(png)
    row = {"images": ["pics/p.png"], "_source": {"file": str(tmp_path / "train.parquet"), "row": 0}}
    assert row_images(row) == (png,)
    assert row_images({"images": []}) == () and row_images({"images": None}) == ()


# ----- headers and pixels --------------------------------------------------------------------------------------

def test_header_size_needs_no_pixels_and_open_image_decodes_them():
    png = _image(64, 40)
    truncated = png[: len(png) // 2]  # the header is intact, the pixel data cut
    assert header_size(truncated, "img") == (64, 40)
    with pytest.raises(DataError, match="img: cannot decode the image"):
        open_image(truncated, "img")
    with pytest.raises(DataError, match=r"img: not a readable image \(9 bytes"):
        header_size(b"not a png", "img")


def test_small_images_are_scaled_up_to_a_28_pixel_short_side():
    assert upscaled_size(10, 5) == (56, 28) and upscaled_size(20, 100) == (28, 140)
    assert upscaled_size(28, 500) == (28, 500) and upscaled_size(300, 200) == (300, 200)
    image = open_image(_image(10, 5))
    assert image.size == (56, 28) and image.mode == "RGB"


def test_open_image_converts_to_rgb_over_white():
    out = io.BytesIO()
    Image.new("RGBA", (30, 30), (10, 20, 30, 0)).save(out, format="PNG")  # fully transparent
    assert open_image(out.getvalue()).getpixel((5, 5)) == (255, 255, 255)
    grey = open_image(_image(30, 30, mode="L"))
    assert grey.mode == "RGB" and len(set(grey.getpixel((3, 3)))) == 1
    assert open_image(_image(30, 30, fmt="JPEG")).size == (30, 30)


# ----- placeholders ---------------------------------------------------------------------------------------------

def test_placeholders_become_image_entries_in_place():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>Compare<image> them."}]
    assert place_images(messages, 2, "w") == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
                                     {"type": "text", "text": " them."}]}]
    assert place_images(messages[:1], 0, "w") == messages[:1]  # a text row is left as it is


def test_without_placeholders_images_go_before_the_first_user_text():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compare them."},
                {"role": "user", "content": "Again."}]
    placed = place_images(messages, 2, "w")
    assert placed[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]
    assert placed[2]["content"] == [{"type": "text", "text": "Again."}]


def test_placeholder_count_must_equal_the_image_count():
    messages = [{"role": "user", "content": "<image> and <image>?"}]
    with pytest.raises(DataError, match=r"f\.parquet row 2: the prompt has 2 <image> placeholder\(s\) but the row "
                                        r"has 3 image\(s\)"):
        place_images(messages, 3, "f.parquet row 2")
    with pytest.raises(DataError, match="no user message"):
        place_images([{"role": "system", "content": "x"}], 1, "w")


# ----- the vision processor against the Hugging Face processor --------------------------------------------------

CASES = [
    ([{"role": "user", "content": "<image>Find x in the figure."}], [(56, 56)]),
    ([{"role": "user", "content": "Which shape is larger?"}], [(200, 30), (10, 5)]),  # no placeholder; tiny image
    ([{"role": "system", "content": "Compare them."},
      {"role": "user", "content": "<image>Find x in the figure.<image>"},
      {"role": "assistant", "content": "\\boxed{3}"},
      {"role": "user", "content": "Which shape is larger? <image>"}], [(300, 90), (112, 112), (29, 400)]),
    ([{"role": "user", "content": "Find x in the figure."}], []),
]


@pytest.mark.parametrize("messages, sizes", CASES)
def test_ids_equal_the_hf_processors(model_dir, monkeypatch, messages, sizes):
    images = tuple(_image(w, h, seed) for seed, (w, h) in enumerate(sizes))
    ours = VisionProcessor.from_pretrained(model_dir)
    processor = _hf_processor(model_dir, monkeypatch)
    ids = ours.render(messages, images)
    assert ids == _hf_ids(processor, messages, images)
    assert VisionProcessor.from_processor(processor).render(messages, images) == ids
    pads = ids.count(ours.image_token_id)
    assert pads == sum(ours.image_tokens(data) for data in images) and (pads > 0) == bool(images)


def test_ids_equal_the_processors_own_chat_rendering(model_dir, monkeypatch):
    """processor.apply_chat_template(tokenize=True) with the decoded images inside the messages."""
    processor = _hf_processor(model_dir, monkeypatch)
    images = (_image(84, 56), _image(20, 60, 1))
    content = [{"type": "image", "image": open_image(images[0])}, {"type": "text", "text": "Compare them."},
               {"type": "image", "image": open_image(images[1])}]
    out = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    ours = VisionProcessor.from_pretrained(model_dir).render(
        [{"role": "user", "content": "<image>Compare them.<image>"}], images)
    assert ours == [int(token) for token in out["input_ids"][0]]


def test_pixel_inputs_match_the_processor_and_feed_the_model(model_dir, monkeypatch):
    from transformers import Qwen2_5_VLForConditionalGeneration

    images = (_image(56, 56), _image(10, 5, 1), _image(150, 40, 2, fmt="JPEG"))
    messages = [{"role": "user", "content": "<image>Compare<image> them.<image>"}]
    ours = VisionProcessor.from_pretrained(model_dir)
    pixels = ours.pixel_inputs(images)
    reference = _hf_processor(model_dir, monkeypatch).image_processor(
        images=[open_image(data) for data in images], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 2, 10]]
    assert torch.equal(pixels["image_grid_thw"], reference["image_grid_thw"])
    assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    ids = ours.render(messages, images)
    assert ids.count(ours.image_token_id) == 4 + 2 + 5
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    with torch.no_grad():  # the model checks that its image tokens match the image features
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits
    assert logits.shape == (1, len(ids), model.config.text_config.vocab_size)


def test_min_and_max_pixels_are_honoured(model_dir, monkeypatch):
    images = (_image(112, 112), _image(30, 30, 1))
    messages = [{"role": "user", "content": "<image><image>Compare them."}]
    default = VisionProcessor.from_pretrained(model_dir)
    assert [default.image_tokens(data) for data in images] == [16, 1]
    bounded = VisionProcessor.from_pretrained(model_dir, min_pixels=56 * 56, max_pixels=56 * 56)
    assert [bounded.image_tokens(data) for data in images] == [4, 4]
    assert bounded.pixel_inputs(images)["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    reference = _hf_processor(model_dir, monkeypatch, min_pixels=56 * 56, max_pixels=56 * 56)
    assert bounded.render(messages, images) == _hf_ids(reference, messages, images)
    with pytest.raises(ValueError, match="need 0 < min_pixels <= max_pixels"):
        VisionProcessor.from_pretrained(model_dir, min_pixels=100, max_pixels=10)


def test_rendering_reads_headers_only_and_pixels_fail_clearly(model_dir):
    ours = VisionProcessor.from_pretrained(model_dir)
    truncated = _image(56, 56)[:200]
    ids = ours.render([{"role": "user", "content": "<image>Find x in the figure."}], (truncated,))
    assert ids.count(ours.image_token_id) == 4
    with pytest.raises(DataError, match=r"images\[0\]: cannot decode the image"):
        ours.pixel_inputs((truncated,))
    with pytest.raises(DataError, match=r"p row 1: image 0: the image processor refuses a 4000x10 image"):
        ours.render([{"role": "user", "content": "<image>"}], (_image(4000, 10),), "p row 1")
    with pytest.raises(DataError, match=r"rendered 2 image token\(s\) for 1 image\(s\)"):
        ours.render([{"role": "user", "content": "<image> <|image_pad|>"}], (_image(56, 56),))


# ----- the prompt renderer -----------------------------------------------------------------------------------------

def test_renderer_gives_image_prompts_and_filters_on_expanded_length(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = PromptRenderer.for_model(model_dir, tokenizer, max_prompt_length=40)
    assert renderer.vision is not None
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "big.png").write_bytes(_image(112, 112))
    source = {"file": str(tmp_path / "train.parquet"), "row": 3}
    small = {"prompt": [{"role": "user", "content": "<image>Find x in the figure."}],
             "images": [{"bytes": _image(56, 56), "path": None}], "_source": source}
    large = dict(small, images=["pics/big.png"])
    text = {"prompt": [{"role": "user", "content": "Find x in the figure."}], "images": [], "_source": source}
    prompt = renderer.prompt(small)
    assert isinstance(prompt, ImagePrompt) and prompt.images == (small["images"][0]["bytes"],)
    assert prompt.ids == renderer.vision.render(small["prompt"], prompt.images)
    assert len(renderer.prompt(large)) == len(prompt) + 12  # 16 image tokens instead of 4
    assert renderer.prompt(text) == renderer.render(text["prompt"]) and isinstance(renderer.prompt(text), list)
    assert renderer.fits(small) and not renderer.fits(large) and len(prompt) <= 40 < len(prompt) + 12


def test_text_models_refuse_image_rows_and_pick_no_vision(tmp_path, model_dir):
    from rl360.quickstart.assets import build_quickstart_model

    text_dir = build_quickstart_model(tmp_path / "text")
    from transformers import AutoTokenizer

    renderer = PromptRenderer.for_model(text_dir, AutoTokenizer.from_pretrained(text_dir), max_prompt_length=64)
    assert renderer.vision is None and is_vision_model(model_dir) and not is_vision_model(text_dir)
    row = {"prompt": [{"role": "user", "content": "1+2"}], "images": [_image(30, 30)],
           "_source": {"file": "d.parquet", "row": 8}}
    with pytest.raises(DataError, match=r"d\.parquet row 8: the row has 1 image\(s\) but the model is text-only"):
        renderer.prompt(row)
    assert renderer.prompt(dict(row, images=None)) == renderer.render(row["prompt"])


def test_a_bad_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"config\.json: cannot be read as JSON"):
        is_vision_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert is_vision_model(tmp_path) and not is_vision_model(tmp_path / "missing")
