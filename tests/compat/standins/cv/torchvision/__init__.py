"""Offline stand-in for the part of ``torchvision`` Accelerate's CV examples use (transforms)."""
