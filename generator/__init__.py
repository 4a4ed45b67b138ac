"""The spec generator: opdefs/*.yaml -> checked specs -> generated Python lowerings."""
