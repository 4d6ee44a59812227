// The step's metadata, copied to the device once as one packed blob and spread here, in one
// launch, into the typed buffers the other kernels read at fixed addresses (which a replayed
// CUDA graph needs).
//
// Blob layout (u32 words), after a header of STEP_HEADER_WORDS:
//   header: tokens, rows, items, page entries, sampled rows, picks slot
//   per token:  id, position, slot, logit row (NO_ROW when its logits are not wanted)
//   per row:    first token, first position, tokens, first page entry, pages
//   page entries
//   per item:   row, first token within the row (2 words)
//   per sampled row: SAMPLE_PARAM_WORDS words
// The engine's step_meta.rs writes exactly this. A token id with FED_TOKEN set is not an id: the
// token is the pick of the step before, row (id - FED_TOKEN), which `sample_rows` left in `fed`
// (a step launched before the host has read the picks it follows).

#define STEP_HEADER_WORDS 8
#define FED_TOKEN 0x80000000u

// grid: any number of blocks; block b copies rows b, b + gridDim.x, ... of the page table.
extern "C" __global__ void unpack_step(const u32* __restrict__ blob, u32* __restrict__ token_ids,
                                       u32* __restrict__ positions, u32* __restrict__ slots,
                                       u32* __restrict__ logit_rows,
                                       u32* __restrict__ row_start_token,
                                       u32* __restrict__ row_start_pos, u32* __restrict__ row_len,
                                       u32* __restrict__ page_table, u32 table_stride,
                                       u32* __restrict__ items_out,
                                       u32* __restrict__ sample_params,
                                       const u32* __restrict__ fed, u32* __restrict__ picks_slot) {
    pdl_begin();
    if (blockIdx.x == 0 && threadIdx.x == 0) *picks_slot = blob[5];
    u32 tokens = blob[0], rows = blob[1], items = blob[2], entries = blob[3], sampled = blob[4];
    const u32* tok = blob + STEP_HEADER_WORDS;
    const u32* row = tok + 4 * tokens;
    const u32* pages = row + 5 * rows;
    const u32* item = pages + entries;
    const u32* sample = item + 2 * items;
    u32 stride = gridDim.x * blockDim.x, first = blockIdx.x * blockDim.x + threadIdx.x;
    for (u32 i = first; i < tokens; i += stride) {
        u32 id = tok[4 * i];
        token_ids[i] = id >= FED_TOKEN ? fed[id - FED_TOKEN] : id;
        positions[i] = tok[4 * i + 1];
        slots[i] = tok[4 * i + 2];
        logit_rows[i] = tok[4 * i + 3];
    }
    for (u32 i = first; i < 2 * items; i += stride) items_out[i] = item[i];
    for (u32 i = first; i < SAMPLE_PARAM_WORDS * sampled; i += stride) sample_params[i] = sample[i];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u32* info = row + 5 * r;
        if (threadIdx.x == 0) {
            row_start_token[r] = info[0];
            row_start_pos[r] = info[1];
            row_len[r] = info[2];
        }
        for (u32 j = threadIdx.x; j < info[4]; j += blockDim.x)
            page_table[(u64)r * table_stride + j] = pages[info[3] + j];
    }
}
