"""A model config saved beside a model (an HF ``config.json``) loads in a process that never
imported the plugin mixers registered where it was saved, unless the model uses them: the
sections of plugins it neither uses nor imports (``model.mixer_modules``) are left out."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAVE = """
import json, sys
sys.path.insert(0, 'tests/parallel')
from test_readme_mixer import load_readme_mixer
load_readme_mixer()                      # registers the README's plugin kind and its section
from ttt_lm.hf import hf_config
from ttt_lm.model.config import ModelConfig, model_config_dict
plain = ModelConfig()                    # the default pattern: built-in kinds only
uses = ModelConfig(layer_pattern=['gated_sum'], n_layers=2)
print(json.dumps({'plain': model_config_dict(plain), 'uses': model_config_dict(uses),
                  'hf': hf_config(plain).to_dict()['ttt_lm'], 'schema_has_it': hasattr(plain, 'gated_sum')}))
"""

LOAD = """
import json, sys
from ttt_lm.hf.configuration_ttt_lm import TTTLMConfig
from ttt_lm.model.config import model_config_from_dict
d = json.load(sys.stdin)
model_config_from_dict(d['plain']).validate()
TTTLMConfig(ttt_lm=d['hf'])
try:
    model_config_from_dict(d['uses'])
except Exception as e:
    print('refused:', e)
"""


def _py(code, stdin=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, input=stdin, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_unused_plugin_sections_stay_out_of_a_saved_config():
    saved = json.loads(_py(SAVE).strip().splitlines()[-1])
    assert saved["schema_has_it"]                       # the process that saved it knew the plugin
    assert "gated_sum" not in saved["plain"] and "gated_sum" not in saved["hf"]
    assert "gated_sum" in saved["uses"]                 # a model that uses the plugin keeps its section
    assert "attention" in saved["plain"]                # built-in sections are all kept
    out = _py(LOAD, stdin=json.dumps(saved))            # a fresh process without the plugin
    assert "refused:" in out and "gated_sum" in out     # the model that needs it names what is missing
