"""The toy verifiers (rewards.answer_reward, solution_reward, image_reward) on boundary layouts: objects in the
first and last row and column, a cell whose flat index and column disagree in order, objects of several cells,
stray colours, several boxes. Every expectation is worked out by hand from the grid drawn in the comment
(cell (row, col) is code index row * 4 + col; colour codes: 1 red, 2 green, 3 blue)."""
import pytest

import rewards

R, G, B = 1, 2, 3


def grid(**cells):
    """A 4 x 4 grid of code 0 with the given cells set: grid(r03=R) puts red at row 0, column 3."""
    codes = [0] * 16
    for name, code in cells.items():
        codes[int(name[1]) * 4 + int(name[2])] = code
    return codes


def spec(counts, relation=None, place=None):
    return {"spec": {"width": 4, "counts": counts, "relation": relation, "place": place}}


ONE_EACH = {"red": 1, "blue": 1}


@pytest.mark.parametrize("codes,relation,want", [
    (grid(r20=R, r21=B), ("red", "left of", "blue"), 1.0),        # same row, adjacent columns
    (grid(r01=R, r31=B), ("red", "left of", "blue"), 0.75),       # same column: not strictly left
    (grid(r01=R, r31=B), ("red", "above", "blue"), 1.0),          # rows 0 < 3
    # red at (0, 3), index 3; blue at (1, 0), index 4: red is RIGHT of blue by column and above it by row,
    # though its flat index is smaller; a verifier comparing indices, or rows for columns, gets these wrong.
    (grid(r03=R, r10=B), ("red", "right of", "blue"), 1.0),
    (grid(r03=R, r10=B), ("red", "left of", "blue"), 0.75),
    (grid(r03=R, r10=B), ("red", "above", "blue"), 1.0),
    (grid(r30=R, r03=B), ("red", "below", "blue"), 1.0),          # last row against first row
    (grid(r30=R, r03=B), ("red", "right of", "blue"), 0.75),      # column 0 is left of column 3
])
def test_relations_at_the_edges(codes, relation, want):
    # checks: red count, blue count, no stray colour, the relation -> 4 checks, each worth 1/4
    assert rewards.image_reward(codes, spec(ONE_EACH, relation=relation)) == want


def test_a_relation_holds_for_every_cell_of_an_object():
    codes = grid(r00=R, r30=R, r11=B)  # red in column 0 at rows 0 and 3, blue at (1, 1)
    two_reds = {"red": 2, "blue": 1}
    assert rewards.image_reward(codes, spec(two_reds, relation=("red", "left of", "blue"))) == 1.0
    # (3, 0) is below (1, 1): "above" fails for one red cell, so the relation check fails
    assert rewards.image_reward(codes, spec(two_reds, relation=("red", "above", "blue"))) == 0.75


@pytest.mark.parametrize("cell,place,want", [
    ("r33", "bottom row", 1.0), ("r33", "right column", 1.0),     # the last cell of the grid
    ("r03", "top row", 1.0), ("r03", "right column", 1.0),
    ("r30", "left column", 1.0), ("r30", "bottom row", 1.0),
    ("r00", "top row", 1.0), ("r00", "left column", 1.0),         # the first cell
    ("r32", "right column", 2 / 3), ("r13", "bottom row", 2 / 3),   # one short of the line
])
def test_places_at_the_edges(cell, place, want):
    # checks: red count, no stray colour, the place -> 3 checks
    assert rewards.image_reward(grid(**{cell: R}), spec({"red": 1}, place=("red", place))) == pytest.approx(want)


def test_stray_colours_counts_and_sizes():
    assert rewards.image_reward(grid(r00=R, r33=G), spec({"red": 1})) == 0.5   # a stray green: 1 of 2 checks
    assert rewards.image_reward(grid(r00=R, r01=R), spec({"red": 2})) == 1.0
    assert rewards.image_reward(grid(r00=R), spec({"red": 2})) == 0.5           # count wrong, colours right
    assert rewards.image_reward(grid(r00=R)[:-1], spec({"red": 1})) == 0.0      # not a 4 x 4 grid
    assert rewards.image_reward(grid(), spec({"red": 1})) == 0.0                # empty: count and colours wrong


@pytest.mark.parametrize("text,answer,want", [
    ("\\boxed{7}", "7", 1.0),                                 # the box alone
    ("3 + 4 = 7 . \\boxed{7} . \\boxed{8}", "8", 1.0),        # the last box counts
    ("3 + 4 = 7 . \\boxed{7} . \\boxed{8}", "7", 0.0),
    ("\\boxed{ 7 }", "7", 1.0),                               # spaces inside the box
    ("\\boxed{7", "7", 0.0),                                  # unterminated
    ("\\boxed{{7}}", "7", 0.0),                               # nested braces are not the toy's format
    ("7", "7", 0.0),                                          # no box
    ("\\boxed{17}", "7", 0.0), ("\\boxed{7}0", "7", 1.0),     # the box's content, not a substring
])
def test_answer_reward_layouts(text, answer, want):
    assert rewards.answer_reward(text, {"answer": answer}) == want


def test_solution_reward_layouts():
    sol = "3 + 4 = 7 . 7 x 2 = 14 . \\boxed{14}"
    assert rewards.solution_reward(sol + "  ", {"solution": sol}) == 1.0       # trailing space
    assert rewards.solution_reward(sol[:-1], {"solution": sol}) == 0.0         # one character short
    assert rewards.solution_reward("7 x 2 = 14 . \\boxed{14}", {"solution": sol}) == 0.0  # a step missing
    assert rewards.solution_reward(sol + " . \\boxed{15}", {"solution": sol}) == 0.0  # more after the solution
