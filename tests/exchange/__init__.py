"""Tests of theanompi.exchange (a package so that module names do not clash)."""
