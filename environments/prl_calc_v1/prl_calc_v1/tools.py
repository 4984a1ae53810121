"""The calculator's tool server: one MCP server (verifiers v1 `Toolset`) for the whole taskset, started
by the environment worker when it starts serving, as a child process in its own Python (verifiers'
subprocess runtime: `python -m prl_calc_v1.tools`, nothing installed), listening on 127.0.0.1 only.

    python -m prl_calc_v1.tools      # what the worker runs (VF_CONFIG and MCP_PORT_FILE in its environment)
"""

import verifiers.v1 as vf


class CalcTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"
    """The model sees the tool as `calc_add` (verifiers prefixes each tool with its server's name)."""

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """a + b"""
        return a + b


if __name__ == "__main__":
    CalcTools.run()
