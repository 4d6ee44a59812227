//! Copy plans: which snapshot page goes to or comes from which working-pool page.
//!
//! Owns the mapping and nothing else; the engine performs the copies. A snapshot is a
//! self-contained buffer of page-sized rows, row `i` holding positions `i * page_tokens ..`. A
//! plan pairs row `i` with page `i` of a page table, whatever that page is: a restore into the
//! very pages a snapshot was saved from (same base) and one into any other pages (relocated) are
//! the same operation, and neither reads pool pages the snapshot was saved from.

use crate::error::CacheError;
use crate::geometry::PageId;

/// Copy one page between snapshot row `snapshot_page` and working-pool page `pool_page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    pub snapshot_page: u32,
    pub pool_page: PageId,
}

/// Copy working-pool page `from` into pool page `to`: how a request's other choices (`n` > 1)
/// take the prompt's KV from the first one instead of computing it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageClone {
    pub from: PageId,
    pub to: PageId,
}

/// The copies giving `to` the first `pages` pages of `from`, page by page.
pub fn page_clones(
    pages: usize,
    from: &[PageId],
    to: &[PageId],
) -> Result<Vec<PageClone>, CacheError> {
    let short = |table: &[PageId]| CacheError::ShortPageTable {
        snapshot_pages: pages,
        table_pages: table.len(),
    };
    let from = from.get(..pages).ok_or_else(|| short(from))?;
    let to = to.get(..pages).ok_or_else(|| short(to))?;
    Ok(from
        .iter()
        .zip(to)
        .map(|(&from, &to)| PageClone { from, to })
        .collect())
}

/// The copies between a snapshot of `snapshot_pages` pages and the start of `page_table`.
pub fn page_copies(
    snapshot_pages: usize,
    page_table: &[PageId],
) -> Result<Vec<PageCopy>, CacheError> {
    let table = page_table
        .get(..snapshot_pages)
        .ok_or(CacheError::ShortPageTable {
            snapshot_pages,
            table_pages: page_table.len(),
        })?;
    Ok(table
        .iter()
        .enumerate()
        .map(|(row, &pool_page)| PageCopy {
            snapshot_page: row as u32,
            pool_page,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_with_the_head_of_the_page_table() {
        let table = [PageId(7), PageId(2), PageId(9)];
        assert_eq!(
            page_copies(2, &table).unwrap(),
            vec![
                PageCopy {
                    snapshot_page: 0,
                    pool_page: PageId(7)
                },
                PageCopy {
                    snapshot_page: 1,
                    pool_page: PageId(2)
                },
            ]
        );
        assert!(matches!(
            page_copies(4, &table),
            Err(CacheError::ShortPageTable {
                snapshot_pages: 4,
                table_pages: 3
            })
        ));
    }
}
