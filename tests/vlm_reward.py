"""A reward for the vision-language tests: checks it received each completion's images, then scores the colour."""

from PIL import Image


def color_reward(completions, images, color, **kwargs):
    """1.0 if the completion names its image's colour. The `images` column arrives per completion (each prompt's
    value repeated G times): the first image's pixel must be the row's `color`, or the images were misaligned."""
    assert len(images) == len(completions) == len(color)
    for paths, want in zip(images, color):
        assert Image.open(paths[0]).convert("RGB").getpixel((0, 0)) == {"red": (255, 0, 0), "blue": (0, 0, 255)}[want]
    return [float(want[0] in c[0]["content"]) for c, want in zip(completions, color)]
