import math

import pytest
import torch

from fasttomo.geometry.so3 import (random_quaternions, rot_y, rot_z, rotation_from_matrix,
                                   rotation_from_quaternion)


def _assert_rotation(r, atol=1e-5):
    eye = torch.eye(3, dtype=r.dtype).expand_as(r)
    torch.testing.assert_close(r @ r.transpose(-1, -2), eye, atol=atol, rtol=0)
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(r.shape[:-2], dtype=r.dtype), atol=atol, rtol=0)


def test_rot_y_rot_z_match_the_documented_matrices():
    th = torch.tensor([0.3, -1.1])
    c, s = math.cos(0.3), math.sin(0.3)
    torch.testing.assert_close(rot_y(th)[0], torch.tensor([[c, 0, s], [0, 1, 0], [-s, 0, c]]))
    torch.testing.assert_close(rot_z(th)[0], torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1]]))
    assert rot_y(torch.zeros(4, 5)).shape == (4, 5, 3, 3)
    _assert_rotation(rot_y(th))
    _assert_rotation(rot_z(th))


def test_svd_projection_gives_rotations_even_for_negative_determinant():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(64, 3, 3, generator=g)
    assert (torch.linalg.det(m) < 0).any() and (torch.linalg.det(m) > 0).any()
    _assert_rotation(rotation_from_matrix(m))
    # a rotation is its own projection, and the projection is the closest rotation
    r = rotation_from_quaternion(random_quaternions(8, generator=g))
    torch.testing.assert_close(rotation_from_matrix(r), r, atol=1e-5, rtol=0)
    torch.testing.assert_close(rotation_from_matrix(3.0 * r), r, atol=1e-5, rtol=0)
    flipped = r.clone()
    flipped[:, :, 2] *= -1  # det -1 reflection
    out = rotation_from_matrix(flipped)
    _assert_rotation(out)


def test_svd_projection_gradient_is_finite_at_identity_and_matches_finite_differences():
    g = torch.Generator().manual_seed(1)
    eye = torch.eye(3, dtype=torch.float64).repeat(2, 1, 1).requires_grad_(True)
    w = torch.randn(2, 3, 3, dtype=torch.float64, generator=g)
    (rotation_from_matrix(eye) * w).sum().backward()
    assert torch.isfinite(eye.grad).all() and eye.grad.abs().sum() > 0
    # gradcheck at the (degenerate) identity, at a random rotation and at generic matrices
    for m in (torch.eye(3, dtype=torch.float64)[None],
              rotation_from_quaternion(random_quaternions(2, generator=g, dtype=torch.float64)),
              torch.randn(3, 3, 3, dtype=torch.float64, generator=g)):
        assert torch.autograd.gradcheck(rotation_from_matrix, (m.clone().requires_grad_(True),))


def test_quaternion_rotation_is_normalized_and_correct():
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(32, 4, generator=g) * 3).requires_grad_(True)
    r = rotation_from_quaternion(q)
    _assert_rotation(r)
    r.sum().backward()
    assert torch.isfinite(q.grad).all()
    a = 0.7  # rotation about z by a: q = (cos a/2, 0, 0, sin a/2), any scale
    qz = 5 * torch.tensor([math.cos(a / 2), 0.0, 0.0, math.sin(a / 2)])
    torch.testing.assert_close(rotation_from_quaternion(qz), rot_z(torch.tensor(a)))
    qy = torch.tensor([math.cos(a / 2), 0.0, math.sin(a / 2), 0.0])
    torch.testing.assert_close(rotation_from_quaternion(qy), rot_y(torch.tensor(a)))
    q64 = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(rotation_from_quaternion, (q64,))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError):
        rotation_from_matrix(torch.zeros(3, 4))
    with pytest.raises(ValueError):
        rotation_from_quaternion(torch.zeros(3))
