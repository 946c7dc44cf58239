"""Helpers the test files share: test files import them from here, never from one another."""
