"""The command line's integer lists (``--samples``, ``--layers``, ``--heads``, ``--images``)."""

from __future__ import annotations

import pytest

from randattn.cli._parsing import parse_int_list


def test_items_and_ranges_in_order_once():
    assert parse_int_list("--layers", "0,2,5-7, 2") == (0, 2, 5, 6, 7)
    assert parse_int_list("--layers", None) is None


@pytest.mark.parametrize("text", ["64,,256", "16,", ",16", "16, ,32"])
def test_an_empty_item_is_refused_not_dropped(text):
    """``64,,256`` read as (64, 256) hid a number left out; it is refused, naming the list."""
    with pytest.raises(ValueError) as caught:
        parse_int_list("--samples", text, example="16,64 or 4-8")
    assert str(caught.value) == (f"--samples: an empty item in {text!r} (two commas in a row, or one at an end); use "
                                 "integers and ranges like 16,64 or 4-8")


@pytest.mark.parametrize(("text", "says"), [("", "--samples: no values in ''"),
                                            ("8-4", "--samples: cannot read '8-4' in '8-4'"),
                                            ("x", "--samples: cannot read 'x' in 'x'")])
def test_no_values_and_unreadable_items_are_refused(text, says):
    with pytest.raises(ValueError, match="^" + says.replace("'", ".")):
        parse_int_list("--samples", text)


def test_the_command_exits_2_on_an_empty_item(tmp_path):
    import numpy as np
    from click.testing import CliRunner

    from randattn.activations import make_activations, save_activations
    from randattn.cli import main

    rng = np.random.default_rng(0)
    acts = save_activations(make_activations({0: tuple(rng.normal(size=(1, 1, 6, 4)) for _ in range(3))},
                                             {"scale": 0.5, "layout": "sequence"}), tmp_path / "acts.safetensors")
    result = CliRunner().invoke(main, ["mse", str(acts), "--samples", "64,,256", "--out", str(tmp_path / "t.csv")])
    assert result.exit_code == 2 and "an empty item in '64,,256'" in result.output


@pytest.mark.parametrize(("args", "says"), [
    (["--replicates", "0"], "error: --replicates must be >= 1, got 0"),
    (["--threads", "0"], "error: --threads must be >= 1, got 0"),
    (["-e", "vattention:epsilon=abc"], "error: estimator 'vattention:epsilon=abc': epsilon must be int/float, got str "
                                       "'abc'"),
    (["-e", "rfa:coupling=foo"], "error: estimator 'rfa:coupling=foo': coupling='foo' is not allowed"),
    (["-e", "rfa:foo=1"], "error: unknown parameter(s) 'foo' for estimator 'rfa'"),
    (["-e", "foo"], "error: unknown estimator 'foo'; known estimators:"),
])
def test_a_refused_count_or_parameter_value_names_its_option_or_estimator(tmp_path, args, says):
    """Each refusal says which of the command's options or estimators it is about (the messages named neither), and
    one that named its estimator already is not prefixed again."""
    import numpy as np
    from click.testing import CliRunner

    from randattn.activations import make_activations, save_activations
    from randattn.cli import main

    rng = np.random.default_rng(0)
    acts = save_activations(make_activations({0: tuple(rng.normal(size=(1, 1, 6, 4)) for _ in range(3))},
                                             {"scale": 0.5, "layout": "sequence"}), tmp_path / "acts.safetensors")
    result = CliRunner().invoke(main, ["mse", str(acts), "--samples", "4", *args, "--out", str(tmp_path / "t.csv")])
    assert result.exit_code == 2
    assert " ".join(result.output.split()).startswith(says), result.output
