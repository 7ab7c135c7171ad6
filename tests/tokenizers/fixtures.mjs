// Folders the reference test derives from the real files, for forms no npm
// package ships as a file of its own:
//   node fixtures.mjs LLAMA2_DIR LLAMA3_1_DIR TEMPLATES_DIR OUT_DIR
//   - mistral-metaspace/: Llama 2's vocabulary in the tokenizer.json form of
//     Mistral v0.3's fast tokenizer (no normalizer; pre_tokenizer Metaspace
//     with prepend_scheme "first", split false; the same decoders), with a
//     chat template of Mistral v0.3's form (system_message, no space before
//     [/INST]) written from its published template, not a copy of the file;
//   - metaspace-split/: Metaspace with prepend_scheme "always", split true,
//     and the Metaspace decoder;
//   - mistral-v0.1/: Llama 2's tokenizer.json with Mistral v0.1's
//     [INST] template (' [/INST]', no system role);
//   - llama3.1-instruct/, llama3.2-instruct/: Llama 3.1's tokenizer.json and
//     tokenizer_config.json with the chat_template of Llama 3.1 (also 3.3's)
//     and of Llama 3.2 Instruct, the dated system header (strftime_now in
//     3.2's), as Meta publishes them (TEMPLATES_DIR/*.jinja, copied from
//     public copies of meta-llama/Llama-3.1-8B-Instruct's and
//     meta-llama/Llama-3.2-1B-Instruct's tokenizer_config.json);
//   - llama2-chat/: Llama 2's files with Llama-2-*-chat-hf's [INST] <<SYS>>
//     template (TEMPLATES_DIR/llama2-chat.jinja, likewise).
// Hugging Face's implementations run these files as they are; the test asks
// only that dtp runs them the same.
import fs from 'fs';
import path from 'path';

const [llama2, llama31, templates, out] = process.argv.slice(2);
const base = JSON.parse(fs.readFileSync(path.join(llama2, 'tokenizer.json'), 'utf8'));
const baseConfig = JSON.parse(fs.readFileSync(path.join(llama2, 'tokenizer_config.json'), 'utf8'));

const write = (name, tokenizer, template, config = baseConfig) => {
  const dir = path.join(out, name);
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tokenizer));
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify({ ...config, chat_template: template }));
};
const template = (name) => fs.readFileSync(path.join(templates, name), 'utf8');

const mistralV01 =
  "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}" +
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}" +
  "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}" +
  "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}" +
  "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

const mistralV03 =
  "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}" +
  "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}" +
  "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}" +
  "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}" +
  "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}" +
  "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}" +
  "{%- else %}{{- raise_exception('Only user, assistant and system roles are supported!') }}{%- endif %}{%- endfor %}";

const decoders = base.decoder;
write('mistral-metaspace', {
  ...base,
  normalizer: null,
  pre_tokenizer: { type: 'Metaspace', replacement: '\u2581', prepend_scheme: 'first', split: false },
  decoder: decoders,
}, mistralV03);
write('metaspace-split', {
  ...base,
  normalizer: null,
  pre_tokenizer: { type: 'Metaspace', replacement: '\u2581', prepend_scheme: 'always', split: true },
  decoder: { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, { type: 'Metaspace', replacement: '\u2581',
                                                                          prepend_scheme: 'always', split: true }] },
}, mistralV03);
write('mistral-v0.1', base, mistralV01);
write('llama2-chat', base, template('llama2-chat.jinja'));

const llama3 = JSON.parse(fs.readFileSync(path.join(llama31, 'tokenizer.json'), 'utf8'));
const llama3Config = JSON.parse(fs.readFileSync(path.join(llama31, 'tokenizer_config.json'), 'utf8'));
write('llama3.1-instruct', llama3, template('llama3.1-instruct.jinja'), llama3Config);
write('llama3.2-instruct', llama3, template('llama3.2-instruct.jinja'), llama3Config);
